//! TLS for every connection taskhub makes, through one stack: rustls with
//! the ring crypto provider, for PostgreSQL (`postgres.rs`), Redis, one
//! server or a cluster (`redis.rs`), and the `--http-url` handler and the
//! alert webhook (`http.rs`).
//!
//! What is trusted: the CA file given ([`Tls::ca_file`] for Redis and HTTP,
//! `sslrootcert` in a PostgreSQL URL), which is then the whole trust store;
//! else the operating system's store, read by rustls-native-certs (which
//! honours `SSL_CERT_FILE` and `SSL_CERT_DIR`). A client certificate
//! ([`Tls::client_cert`], `sslcert` + `sslkey`) answers servers that ask for
//! one (mutual TLS).
//!
//! Nothing here runs for a connection that cannot use TLS (`redis://`,
//! `http://`, `sslmode=disable`): no trust store is read, no TLS context
//! built, which keeps such a process small.

mod http;
mod postgres;
mod redis;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::RootCertStore;

use crate::error::{Error, ErrorKind};

pub(crate) use http::ureq_tls;
pub(crate) use postgres::pg_tls;
pub(crate) use redis::redis_certificates;

/// TLS files for the connections to one kind of server (Redis, or the
/// HTTP endpoints): the CA certificates to trust and a client certificate.
/// Used only with `rediss://` and `https://` URLs.
///
/// ```
/// let tls = taskhub::Tls::default()
///     .ca_file("/etc/taskhub/redis-ca.pem")
///     .client_cert("/etc/taskhub/client.pem", "/etc/taskhub/client.key");
/// # drop(tls);
/// ```
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Tls {
    ca_file: Option<PathBuf>,
    client_cert: Option<(PathBuf, PathBuf)>,
}

impl Tls {
    /// A PEM file with the CA certificate(s) that servers are verified
    /// against, instead of the operating system's store. Defaults to none:
    /// the system's store (and `SSL_CERT_FILE` / `SSL_CERT_DIR`).
    pub fn ca_file(mut self, path: impl Into<PathBuf>) -> Tls {
        self.ca_file = Some(path.into());
        self
    }

    /// A client certificate (PEM, the chain starting with the client's own
    /// certificate) and its private key (PEM: PKCS#8, PKCS#1 or SEC1), for
    /// servers that require one. Defaults to none.
    pub fn client_cert(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Tls {
        self.client_cert = Some((cert.into(), key.into()));
        self
    }

    /// Whether no file is set: the system's store, no client certificate.
    pub(crate) fn is_default(&self) -> bool {
        self.ca_file.is_none() && self.client_cert.is_none()
    }
}

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tls")
            .field("ca_file", &self.ca_file)
            .field("client_cert", &self.client_cert.as_ref().map(|(c, _)| c))
            .field("client_key", &self.client_cert.as_ref().map(|(_, k)| k))
            .finish()
    }
}

/// The one crypto provider: ring (aws-lc-rs is not compiled in).
pub(crate) fn provider() -> Arc<CryptoProvider> {
    static PROVIDER: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    PROVIDER
        .get_or_init(|| Arc::new(rustls::crypto::ring::default_provider()))
        .clone()
}

/// Makes ring the process' default provider unless the program chose one:
/// redis-rs builds its TLS settings from the process default and offers no
/// way to pass a provider.
pub(crate) fn install_default_provider() {
    if CryptoProvider::get_default().is_none() {
        // Another thread may win the race; then its choice stands.
        let _ = CryptoProvider::install_default((*provider()).clone());
    }
}

fn file_error(what: &str, path: &Path, e: impl fmt::Display) -> Error {
    Error::new(
        ErrorKind::Config,
        format!("cannot read {what} {}: {e}", path.display()),
    )
}

/// The certificates of a PEM file; at least one.
pub(crate) fn read_certs(what: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, Error> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| file_error(what, path, pem_error(e)))?;
    if certs.is_empty() {
        return Err(file_error(what, path, "no PEM certificate in it"));
    }
    Ok(certs)
}

/// The private key of a PEM file.
fn read_key(what: &str, path: &Path) -> Result<PrivateKeyDer<'static>, Error> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| file_error(what, path, pem_error(e)))
}

fn pem_error(e: rustls::pki_types::pem::Error) -> String {
    match e {
        rustls::pki_types::pem::Error::Io(e) => e.to_string(),
        rustls::pki_types::pem::Error::NoItemsFound => "no PEM item of the expected kind".into(),
        other => format!("not valid PEM ({other:?})"),
    }
}

/// A trust store holding the certificates of the CA file `path`.
pub(crate) fn ca_roots(what: &str, path: &Path) -> Result<RootCertStore, Error> {
    let mut roots = RootCertStore::empty();
    for cert in read_certs(what, path)? {
        roots
            .add(cert)
            .map_err(|e| file_error(what, path, format!("not a CA certificate: {e}")))?;
    }
    Ok(roots)
}

/// The operating system's trust store (with `SSL_CERT_FILE` and
/// `SSL_CERT_DIR` when set). Certificates that cannot be read are logged and
/// skipped, as a TLS library reading the store would.
pub(crate) fn system_roots() -> Vec<CertificateDer<'static>> {
    let found = rustls_native_certs::load_native_certs();
    for e in &found.errors {
        log::warn!("tls: the system's trust store: {e}");
    }
    if found.certs.is_empty() {
        log::warn!("tls: no CA certificate found in the system's trust store");
    }
    found.certs
}

/// The trust store for `ca_file`, else the system's.
pub(crate) fn roots(what: &str, ca_file: Option<&Path>) -> Result<RootCertStore, Error> {
    match ca_file {
        Some(path) => ca_roots(what, path),
        None => {
            let mut roots = RootCertStore::empty();
            roots.add_parsable_certificates(system_roots());
            Ok(roots)
        }
    }
}

/// A client certificate chain and its key, read and checked against each
/// other (a key that does not belong to the certificate is a start-up
/// error, not a failed handshake later).
pub(crate) fn client_identity(
    what: &str,
    cert: &Path,
    key: &Path,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), Error> {
    let chain = read_certs(&format!("{what} certificate"), cert)?;
    let key_der = read_key(&format!("{what} key"), key)?;
    rustls::sign::CertifiedKey::from_der(chain.clone(), key_der.clone_key(), &provider()).map_err(
        |e| {
            Error::new(
                ErrorKind::Config,
                format!(
                    "{what} certificate {} and key {} do not go together: {e}",
                    cert.display(),
                    key.display()
                ),
            )
        },
    )?;
    Ok((chain, key_der))
}
