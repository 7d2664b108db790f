//! Certificates for the TLS tests, made with the `openssl` command: a CA, a
//! server certificate it signs, for 127.0.0.1 and localhost, and client
//! certificates it signs, for mutual TLS.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .expect("the openssl command is installed");
    assert!(
        out.status.success(),
        "openssl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA (`<name>.pem`) and, signed by it, a server certificate for
/// 127.0.0.1 and localhost (`<name>-server.pem`, `<name>-server.key`).
pub struct Certs {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    ca_key: PathBuf,
    dir: PathBuf,
}

/// A client certificate and its key.
pub struct Client {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Certs {
    /// A client certificate signed by this CA, for the user `cn` (PostgreSQL
    /// maps the common name to the user with `cert` authentication).
    pub fn client(&self, cn: &str) -> Client {
        let stem = format!(
            "{}-client-{cn}",
            self.ca.file_stem().unwrap().to_str().unwrap()
        );
        let (key, csr, cert, ext) = (
            format!("{stem}.key"),
            format!("{stem}.csr"),
            format!("{stem}.pem"),
            format!("{stem}.ext"),
        );
        let subject = format!("/CN={cn}");
        let mut args = vec!["req", "-nodes"];
        args.extend(EC);
        args.extend(["-keyout", &key, "-out", &csr, "-subj", &subject]);
        openssl(&self.dir, &args);
        std::fs::write(
            self.dir.join(&ext),
            "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=clientAuth\n",
        )
        .unwrap();
        let (ca, ca_key) = (self.ca.to_str().unwrap(), self.ca_key.to_str().unwrap());
        openssl(
            &self.dir,
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                ca,
                "-CAkey",
                ca_key,
                "-CAcreateserial",
                "-out",
                &cert,
                "-days",
                "2",
                "-extfile",
                &ext,
            ],
        );
        Client {
            cert: self.dir.join(cert),
            key: self.dir.join(key),
        }
    }
}

const EC: [&str; 4] = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"];

pub fn make_certs(dir: &Path, name: &str) -> Certs {
    let ec = EC;
    let (ca_key, ca) = (format!("{name}.key"), format!("{name}.pem"));
    let mut args = vec!["req", "-x509", "-nodes", "-days", "2"];
    args.extend(ec);
    args.extend(["-keyout", &ca_key, "-out", &ca]);
    let subject = format!("/CN=taskhub test CA {name}");
    args.extend(["-subj", &subject]);
    openssl(dir, &args);

    let (key, csr, cert) = (
        format!("{name}-server.key"),
        format!("{name}-server.csr"),
        format!("{name}-server.pem"),
    );
    let mut args = vec!["req", "-nodes"];
    args.extend(ec);
    args.extend(["-keyout", &key, "-out", &csr, "-subj", "/CN=localhost"]);
    openssl(dir, &args);
    let ext = format!("{name}.ext");
    std::fs::write(
        dir.join(&ext),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n\
         keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n",
    )
    .unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &ca,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-out",
            &cert,
            "-days",
            "2",
            "-extfile",
            &ext,
        ],
    );
    Certs {
        ca: dir.join(ca),
        cert: dir.join(cert),
        key: dir.join(key),
        ca_key: dir.join(ca_key),
        dir: dir.to_owned(),
    }
}
