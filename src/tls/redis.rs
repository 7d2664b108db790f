//! TLS files for redis-rs, for one server and for a cluster alike (redis-rs
//! takes a custom CA and a client certificate for a cluster only with
//! rustls, one of the reasons for one stack).
//!
//! redis-rs builds its rustls settings itself, for each new connection:
//! from the CA file when one is given, else from the system's store. We
//! read and check the files once, here, so a missing file or a key that
//! does not match its certificate is a start-up error with the file's name.

use super::{ca_roots, client_identity, Tls};
use crate::error::Error;

/// The certificates redis-rs wants for `tls`, or `None` for the defaults
/// (the system's store, no client certificate). Makes ring the process'
/// default crypto provider if none is (redis-rs takes it from there).
pub(crate) fn redis_certificates(tls: &Tls) -> Result<Option<redis::TlsCertificates>, Error> {
    super::install_default_provider();
    if tls.is_default() {
        return Ok(None);
    }
    let root_cert = match &tls.ca_file {
        Some(path) => {
            ca_roots("the Redis CA file", path)?;
            Some(read("the Redis CA file", path)?)
        }
        None => None,
    };
    let client_tls = match &tls.client_cert {
        Some((cert, key)) => {
            client_identity("the Redis client", cert, key)?;
            Some(redis::ClientTlsConfig {
                client_cert: read("the Redis client certificate", cert)?,
                client_key: read("the Redis client key", key)?,
            })
        }
        None => None,
    };
    Ok(Some(redis::TlsCertificates {
        client_tls,
        root_cert,
    }))
}

fn read(what: &str, path: &std::path::Path) -> Result<Vec<u8>, Error> {
    std::fs::read(path).map_err(|e| super::file_error(what, path, e))
}
