//! TLS for PostgreSQL, with libpq's URL parameters and their meanings:
//!
//! | `sslmode` | TLS | certificate checked |
//! | --- | --- | --- |
//! | `disable` | never | - |
//! | `prefer` (default) | when the server offers it | no |
//! | `require` | always | no; with `sslrootcert`, the chain (as libpq does) |
//! | `verify-ca` | always | the chain, not the host name |
//! | `verify-full` | always | the chain and the host name |
//!
//! `sslrootcert` names the CA file, which is then the whole trust store
//! (without it, the system's store); `sslcert` and `sslkey` a client
//! certificate and its key. rust-postgres knows `disable`, `prefer` and
//! `require` only and none of the files, so [`pg_tls`] takes them out of
//! the URL and the connector made here does the rest (through
//! tokio-postgres-rustls, which also gives SCRAM its channel binding).

use std::path::PathBuf;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, SignatureScheme};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::{client_identity, provider, roots};
use crate::error::{Error, ErrorKind};
use crate::net::percent_decode;

/// libpq's `sslmode`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum SslMode {
    Disable,
    #[default]
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

/// What is checked of the server's certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Check {
    Nothing,
    Chain,
    ChainAndName,
}

/// The TLS settings of a PostgreSQL URL.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct PgTls {
    mode: SslMode,
    root_cert: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
}

/// Splits the TLS settings off `url` (URL form
/// `postgres://...?sslmode=verify-full&sslrootcert=/ca.pem` or key-value
/// form `host=db sslmode=verify-full sslrootcert=/ca.pem`) and returns what
/// rust-postgres can parse, with the `sslmode` it knows in their place.
pub(crate) fn pg_tls(url: &str) -> Result<(String, PgTls), String> {
    let mut tls = PgTls::default();
    let mut given = false;
    let mut take = |key: &str, value: &str| -> Result<bool, String> {
        let path = || match value {
            "" => Err(format!("empty {key}")),
            v => Ok(Some(PathBuf::from(v))),
        };
        match key {
            "sslmode" => {
                tls.mode = match value {
                    "disable" => SslMode::Disable,
                    "prefer" => SslMode::Prefer,
                    "require" => SslMode::Require,
                    "verify-ca" => SslMode::VerifyCa,
                    "verify-full" => SslMode::VerifyFull,
                    other => {
                        return Err(format!(
                            "sslmode {other:?} is not one of disable, prefer, require, \
                             verify-ca, verify-full"
                        ))
                    }
                };
                given = true;
            }
            "sslrootcert" => tls.root_cert = path()?,
            "sslcert" => tls.cert = path()?,
            "sslkey" => tls.key = path()?,
            _ => return Ok(false),
        }
        Ok(true)
    };
    let rebuilt = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let (base, query) = url.split_once('?').unwrap_or((url, ""));
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            if !take(k, &percent_decode(v))? {
                kept.push(pair.to_owned());
            }
        }
        if given {
            kept.push(format!("sslmode={}", tls.mode.for_rust_postgres()));
        }
        if kept.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", kept.join("&"))
        }
    } else {
        let mut kept = Vec::new();
        for word in url.split_whitespace() {
            let (k, v) = word.split_once('=').unwrap_or((word, ""));
            if !take(k.trim(), v.trim_matches('\'').trim())? {
                kept.push(word.to_owned());
            }
        }
        if given {
            kept.push(format!("sslmode={}", tls.mode.for_rust_postgres()));
        }
        kept.join(" ")
    };
    Ok((rebuilt, tls))
}

impl SslMode {
    fn for_rust_postgres(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => "require",
        }
    }
}

impl PgTls {
    fn check(&self) -> Check {
        match self.mode {
            SslMode::Disable | SslMode::Prefer => Check::Nothing,
            SslMode::Require if self.root_cert.is_some() => Check::Chain,
            SslMode::Require => Check::Nothing,
            SslMode::VerifyCa => Check::Chain,
            SslMode::VerifyFull => Check::ChainAndName,
        }
    }

    /// The connector for these settings; `None` with `sslmode=disable`,
    /// when no TLS context is built at all. The system's store is read only
    /// when a chain is checked without `sslrootcert`.
    pub(crate) fn connector(&self) -> Result<Option<MakeRustlsConnect>, Error> {
        if self.mode == SslMode::Disable {
            return Ok(None);
        }
        let provider = provider();
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::with_source(ErrorKind::Config, "TLS for PostgreSQL", e))?;
        let check = self.check();
        let builder = match check {
            Check::Nothing => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AcceptAnyCertificate {
                    algorithms: provider.signature_verification_algorithms,
                })),
            Check::Chain | Check::ChainAndName => {
                let roots = Arc::new(roots("sslrootcert", self.root_cert.as_deref())?);
                let webpki = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
                    .build()
                    .map_err(|e| {
                        Error::with_source(
                            ErrorKind::Config,
                            "no usable CA certificate for PostgreSQL",
                            e,
                        )
                    })?;
                if check == Check::Chain {
                    builder
                        .dangerous()
                        .with_custom_certificate_verifier(Arc::new(ChainOnly(webpki)))
                } else {
                    builder.with_webpki_verifier(webpki)
                }
            }
        };
        let mut config = match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                let (chain, key) = client_identity("the PostgreSQL client (sslcert)", cert, key)?;
                builder.with_client_auth_cert(chain, key).map_err(|e| {
                    Error::with_source(ErrorKind::Config, "sslcert and sslkey of PostgreSQL", e)
                })?
            }
            (None, None) => builder.with_no_client_auth(),
            _ => {
                return Err(Error::new(
                    ErrorKind::Config,
                    "sslcert and sslkey go together in a PostgreSQL URL",
                ))
            }
        };
        // As libpq 17 does; PostgreSQL requires it with sslnegotiation=direct.
        config.alpn_protocols = vec![b"postgresql".to_vec()];
        Ok(Some(MakeRustlsConnect::new(config)))
    }
}

/// `prefer` and `require` (without `sslrootcert`): encrypted, the
/// certificate taken as it comes (the handshake's signatures are still
/// checked, so the server holds the key of the certificate it shows).
#[derive(Debug)]
struct AcceptAnyCertificate {
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for AcceptAnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// `verify-ca`: the chain must lead to a trusted CA; the host name is not
/// looked at. rustls checks the chain before the name, so a name error
/// means the chain was good.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::{pg_tls, Check, PgTls, SslMode};

    #[test]
    fn tls_settings_are_split_off_postgres_urls() {
        let (rest, tls) = pg_tls(
            "postgres://u@db/app?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem\
             &sslcert=/c.pem&sslkey=/c.key",
        )
        .unwrap();
        assert_eq!(rest, "postgres://u@db/app?sslmode=require");
        assert_eq!(
            tls,
            PgTls {
                mode: SslMode::VerifyFull,
                root_cert: Some("/etc/ca.pem".into()),
                cert: Some("/c.pem".into()),
                key: Some("/c.key".into()),
            }
        );
        assert_eq!(tls.check(), Check::ChainAndName);
        let (rest, tls) = pg_tls("postgres://db/app?application_name=x&sslmode=verify-ca").unwrap();
        assert_eq!(rest, "postgres://db/app?application_name=x&sslmode=require");
        assert_eq!(tls.check(), Check::Chain);
        let (rest, tls) = pg_tls("postgres://db/app?sslmode=require").unwrap();
        assert_eq!(rest, "postgres://db/app?sslmode=require");
        assert_eq!(tls.check(), Check::Nothing);
        // require with a CA file checks the chain, as libpq does.
        let (_, tls) = pg_tls("postgres://db/app?sslmode=require&sslrootcert=/ca.pem").unwrap();
        assert_eq!(tls.check(), Check::Chain);
        let (rest, tls) =
            pg_tls("host=db sslmode=verify-full sslrootcert=/ca.pem user=me").unwrap();
        assert_eq!(rest, "host=db user=me sslmode=require");
        assert_eq!(tls.root_cert.as_deref(), Some("/ca.pem".as_ref()));
        let (rest, tls) = pg_tls("postgres://db/app").unwrap();
        assert_eq!(
            (rest.as_str(), tls.mode),
            ("postgres://db/app", SslMode::Prefer)
        );
        let (rest, tls) = pg_tls("postgres://db/app?sslmode=disable").unwrap();
        assert_eq!(rest, "postgres://db/app?sslmode=disable");
        assert!(tls.connector().unwrap().is_none());
        assert!(pg_tls("postgres://db/app?sslmode=allow").is_err());
        assert!(pg_tls("postgres://db/app?sslrootcert=").is_err());
    }

    #[test]
    fn a_client_certificate_needs_its_key() {
        let (_, tls) = pg_tls("postgres://db/app?sslmode=require&sslcert=/c.pem").unwrap();
        let err = tls.connector().err().unwrap().to_string();
        assert!(err.contains("sslcert and sslkey"), "{err}");
    }
}
