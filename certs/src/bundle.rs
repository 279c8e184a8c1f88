//! The kubernetes.io/tls Secret layout on disk: `ca.crt`, `tls.crt`, `tls.key`.

use std::fmt;
use std::fs::{self, OpenOptions};
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;

use crate::error::{Error, Result};

/// File name of the CA certificate.
pub const CA_CERT_FILE: &str = "ca.crt";
/// File name of the serving certificate.
pub const TLS_CERT_FILE: &str = "tls.crt";
/// File name of the serving private key.
pub const TLS_KEY_FILE: &str = "tls.key";
/// File name of the CA private key (only written on request).
pub const CA_KEY_FILE: &str = "ca.key";

/// Base64 of a CA PEM, as used for a webhook configuration's `caBundle`.
pub fn ca_bundle_base64(ca_pem: &str) -> String {
    STANDARD.encode(ca_pem.as_bytes())
}

/// A CA certificate plus a serving certificate and key, all PEM.
#[derive(Clone, PartialEq, Eq)]
pub struct Bundle {
    /// CA certificate (`ca.crt`).
    pub ca_pem: String,
    /// Serving certificate (`tls.crt`).
    pub cert_pem: String,
    /// Serving private key, PKCS#8 (`tls.key`).
    pub key_pem: String,
}

impl fmt::Debug for Bundle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Bundle")
            .field("ca_pem", &self.ca_pem)
            .field("cert_pem", &self.cert_pem)
            .field("key_pem", &"[elided]")
            .finish()
    }
}

/// Paths written by [`Bundle::write_to_dir`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrittenFiles {
    /// The output directory.
    pub dir: PathBuf,
    /// `<dir>/ca.crt`.
    pub ca_cert: PathBuf,
    /// `<dir>/tls.crt`.
    pub tls_cert: PathBuf,
    /// `<dir>/tls.key` (mode 0600 on Unix).
    pub tls_key: PathBuf,
    /// `<dir>/ca.key` (mode 0600 on Unix) if it was written.
    pub ca_key: Option<PathBuf>,
}

impl WrittenFiles {
    /// Every written path, in write order.
    pub fn paths(&self) -> Vec<&Path> {
        let mut paths = vec![
            self.ca_cert.as_path(),
            self.tls_cert.as_path(),
            self.tls_key.as_path(),
        ];
        paths.extend(self.ca_key.as_deref());
        paths
    }
}

impl Bundle {
    /// Base64 of `ca_pem`, the webhook configuration's `caBundle`.
    pub fn ca_bundle_base64(&self) -> String {
        ca_bundle_base64(&self.ca_pem)
    }

    /// Writes `ca.crt`, `tls.crt` and `tls.key` into `dir` (created if missing).
    ///
    /// Without `overwrite`, fails with [`Error::FileExists`] before writing anything if
    /// any of the files exists. Each file is written to a temporary file in `dir` and
    /// renamed into place, so readers never see a half-written file.
    pub fn write_to_dir(&self, dir: &Path, overwrite: bool) -> Result<WrittenFiles> {
        self.write(dir, None, overwrite)
    }

    /// Like [`Bundle::write_to_dir`], also writing `ca_key_pem` as `ca.key` (mode 0600).
    pub fn write_to_dir_with_ca_key(
        &self,
        dir: &Path,
        ca_key_pem: &str,
        overwrite: bool,
    ) -> Result<WrittenFiles> {
        self.write(dir, Some(ca_key_pem), overwrite)
    }

    fn write(&self, dir: &Path, ca_key_pem: Option<&str>, overwrite: bool) -> Result<WrittenFiles> {
        let mut files = vec![
            OutFile::public(CA_CERT_FILE, &self.ca_pem),
            OutFile::public(TLS_CERT_FILE, &self.cert_pem),
            OutFile::private(TLS_KEY_FILE, &self.key_pem),
        ];
        if let Some(key) = ca_key_pem {
            files.push(OutFile::private(CA_KEY_FILE, key));
        }
        write_files(dir, &files, overwrite)?;
        Ok(WrittenFiles {
            dir: dir.to_path_buf(),
            ca_cert: dir.join(CA_CERT_FILE),
            tls_cert: dir.join(TLS_CERT_FILE),
            tls_key: dir.join(TLS_KEY_FILE),
            ca_key: ca_key_pem.map(|_| dir.join(CA_KEY_FILE)),
        })
    }
}

/// One file to write.
struct OutFile<'a> {
    name: &'static str,
    contents: &'a str,
    private: bool,
}

impl<'a> OutFile<'a> {
    fn public(name: &'static str, contents: &'a str) -> Self {
        OutFile {
            name,
            contents,
            private: false,
        }
    }

    fn private(name: &'static str, contents: &'a str) -> Self {
        OutFile {
            name,
            contents,
            private: true,
        }
    }
}

/// Writes `files` into `dir`: all are staged as temporary files first, then renamed,
/// so a failure while staging leaves existing files untouched.
fn write_files(dir: &Path, files: &[OutFile<'_>], overwrite: bool) -> Result<()> {
    fs::create_dir_all(dir).map_err(|e| Error::io("create directory", dir, e))?;
    if !overwrite {
        for file in files {
            let path = dir.join(file.name);
            match fs::symlink_metadata(&path) {
                Ok(_) => return Err(Error::FileExists { path }),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io("check for existing file", path, e)),
            }
        }
    }
    let mut staged: Vec<(PathBuf, PathBuf)> = Vec::with_capacity(files.len());
    for file in files {
        match stage(dir, file) {
            Ok(tmp) => staged.push((tmp, dir.join(file.name))),
            Err(e) => {
                remove_all(staged.iter().map(|(tmp, _)| tmp));
                return Err(e);
            }
        }
    }
    for (i, (tmp, dest)) in staged.iter().enumerate() {
        if let Err(e) = fs::rename(tmp, dest) {
            remove_all(staged[i..].iter().map(|(tmp, _)| tmp));
            return Err(Error::io("move the new file into place at", dest, e));
        }
    }
    // Persist the renames; some filesystems cannot sync a directory, which is harmless.
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

fn remove_all<'a>(paths: impl Iterator<Item = &'a PathBuf>) {
    for path in paths {
        let _ = fs::remove_file(path);
    }
}

/// Distinguishes temporary files of concurrent writers in one process.
static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Writes `file` to a new temporary file in `dir` and returns its path.
fn stage(dir: &Path, file: &OutFile<'_>) -> Result<PathBuf> {
    let tmp = dir.join(format!(
        ".{}.tmp-{}-{}",
        file.name,
        std::process::id(),
        TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let mut options = OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        // Private files never exist with wider permissions, not even briefly.
        options.mode(if file.private { 0o600 } else { 0o644 });
    }
    let result = options.open(&tmp).and_then(|mut f| {
        #[cfg(unix)]
        if file.private {
            use std::os::unix::fs::PermissionsExt as _;
            f.set_permissions(fs::Permissions::from_mode(0o600))?;
        }
        f.write_all(file.contents.as_bytes())?;
        f.sync_all()
    });
    match result {
        Ok(()) => Ok(tmp),
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            Err(Error::io("write temporary file", tmp, e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bundle(tag: &str) -> Bundle {
        Bundle {
            ca_pem: format!("ca {tag}\n"),
            cert_pem: format!("cert {tag}\n"),
            key_pem: format!("key {tag}\n"),
        }
    }

    fn read(path: &Path) -> String {
        fs::read_to_string(path).expect("read")
    }

    fn leftovers(dir: &Path) -> Vec<String> {
        fs::read_dir(dir)
            .expect("read dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".tmp-"))
            .collect()
    }

    #[test]
    fn writes_secret_layout_into_new_nested_dir() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("a/b");
        let written = bundle("1").write_to_dir(&dir, false).expect("write");
        assert_eq!(written.ca_cert, dir.join("ca.crt"));
        assert_eq!(read(&written.ca_cert), "ca 1\n");
        assert_eq!(read(&written.tls_cert), "cert 1\n");
        assert_eq!(read(&written.tls_key), "key 1\n");
        assert_eq!(written.ca_key, None);
        assert_eq!(written.paths().len(), 3);
        assert!(!dir.join("ca.key").exists());
        assert!(leftovers(&dir).is_empty());
    }

    #[cfg(unix)]
    #[test]
    fn private_files_are_0600() {
        use std::os::unix::fs::PermissionsExt as _;
        let tmp = tempfile::tempdir().expect("tempdir");
        let written = bundle("1")
            .write_to_dir_with_ca_key(tmp.path(), "ca key\n", false)
            .expect("write");
        let mode = |p: &Path| fs::metadata(p).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode(&written.tls_key), 0o600);
        let ca_key = written.ca_key.as_deref().expect("ca key written");
        assert_eq!(mode(ca_key), 0o600);
        assert_eq!(read(ca_key), "ca key\n");
        assert_eq!(mode(&written.tls_cert) & 0o600, 0o600);
    }

    #[test]
    fn refuses_to_overwrite_any_file_and_writes_nothing() {
        let tmp = tempfile::tempdir().expect("tempdir");
        fs::write(tmp.path().join("tls.key"), "old key").expect("seed");
        let err = bundle("1")
            .write_to_dir(tmp.path(), false)
            .expect_err("exists");
        let msg = err.to_string();
        assert!(matches!(err, Error::FileExists { .. }), "{msg}");
        assert!(msg.contains("tls.key"), "{msg}");
        assert!(msg.contains("--force"), "{msg}");
        assert!(
            !tmp.path().join("ca.crt").exists(),
            "nothing may be written"
        );
        assert_eq!(read(&tmp.path().join("tls.key")), "old key");
    }

    #[test]
    fn overwrite_replaces_all_files() {
        let tmp = tempfile::tempdir().expect("tempdir");
        bundle("1").write_to_dir(tmp.path(), false).expect("first");
        bundle("2").write_to_dir(tmp.path(), true).expect("second");
        assert_eq!(read(&tmp.path().join("ca.crt")), "ca 2\n");
        assert_eq!(read(&tmp.path().join("tls.crt")), "cert 2\n");
        assert_eq!(read(&tmp.path().join("tls.key")), "key 2\n");
        assert!(leftovers(tmp.path()).is_empty());
    }

    #[test]
    fn dir_that_is_a_file_is_an_io_error_naming_it() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let file = tmp.path().join("plain");
        fs::write(&file, "x").expect("seed");
        let msg = bundle("1")
            .write_to_dir(&file, false)
            .expect_err("not a dir")
            .to_string();
        assert!(msg.contains("create directory"), "{msg}");
        assert!(msg.contains("plain"), "{msg}");
    }

    #[test]
    fn ca_bundle_is_base64_of_ca_pem() {
        let b = bundle("x");
        assert_eq!(
            STANDARD.decode(b.ca_bundle_base64()).expect("b64"),
            b.ca_pem.as_bytes()
        );
        assert!(!format!("{b:?}").contains("key x"));
    }
}
