//! A real headless Chromium for the pages of `--http` (scripts/test.sh
//! installs Debian's chromium when missing).

use std::path::Path;
use std::process::Command;

use super::TempDir;

/// The DOM after Chromium loaded `url` (scripts, if any, have run), or, with
/// `screenshot`, a PNG of it written there.
pub fn render(url: &str, screenshot: Option<&Path>) -> String {
    let profile = TempDir::new("chromium");
    let mut cmd = Command::new("chromium");
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1280,900",
    ])
    .arg(format!("--user-data-dir={}", profile.0.display()));
    match screenshot {
        Some(path) => cmd.arg(format!("--screenshot={}", path.display())),
        None => cmd.arg("--dump-dom"),
    };
    let out = cmd
        .arg(url)
        .output()
        .expect("chromium is installed (scripts/test.sh installs Debian's chromium)");
    assert!(
        out.status.success(),
        "chromium: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
