//! TLS settings for ureq, the HTTP client of the `--http-url` handler and
//! of the alert webhook: the same provider and the same kind of trust store
//! as for the servers (ureq would otherwise bring its own copy of Mozilla's
//! roots and ignore the system's, so an internal CA could not be used).

use std::sync::Arc;

use ureq::tls::{Certificate, ClientCert, PrivateKey, RootCerts, TlsConfig, TlsProvider};

use super::{client_identity, file_error, read_certs, system_roots, Tls};
use crate::error::Error;

/// ureq's TLS settings for requests to `url`. The system's store is read
/// only for an `https://` URL; for `http://` the store is empty (a
/// redirection to `https://` then fails to verify: give the `https://` URL).
/// ureq builds its TLS context at the first `https://` request only.
pub(crate) fn ureq_tls(url: &str, tls: &Tls) -> Result<TlsConfig, Error> {
    let https = url
        .get(..8)
        .is_some_and(|s| s.eq_ignore_ascii_case("https://"));
    let roots = match (&tls.ca_file, https) {
        (Some(path), _) => read_certs("the HTTP CA file", path)?,
        (None, true) => system_roots(),
        (None, false) => Vec::new(),
    };
    let roots: Vec<Certificate<'static>> = roots
        .iter()
        .map(|c| Certificate::from_der(c.as_ref()).to_owned())
        .collect();
    let client_cert = match &tls.client_cert {
        Some((cert, key)) => {
            // Checked here (ureq would panic on a key of another
            // certificate), then read again in ureq's own form.
            let (chain, _) = client_identity("the HTTP client", cert, key)?;
            let what = "the HTTP client key";
            let pem = std::fs::read(key).map_err(|e| file_error(what, key, e))?;
            let key = PrivateKey::from_pem(&pem).map_err(|e| file_error(what, key, e))?;
            let chain: Vec<Certificate<'static>> = chain
                .iter()
                .map(|c| Certificate::from_der(c.as_ref()).to_owned())
                .collect();
            Some(ClientCert::new_with_certs(&chain, key))
        }
        None => None,
    };
    Ok(TlsConfig::builder()
        .provider(TlsProvider::Rustls)
        .unversioned_rustls_crypto_provider(super::provider())
        .root_certs(RootCerts::Specific(Arc::new(roots)))
        .client_cert(client_cert)
        .build())
}
