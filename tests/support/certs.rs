//! Certificates for the TLS tests, made with the `openssl` command: a CA and
//! a server certificate it signs, for 127.0.0.1 and localhost.

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
}

pub fn make_certs(dir: &Path, name: &str) -> Certs {
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"];
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
    }
}
