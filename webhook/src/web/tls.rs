//! The serving certificate: loaded from a directory (a mounted `kubernetes.io/tls` Secret with
//! `tls.crt` and `tls.key`), served through a [`ResolvesServerCert`] backed by an [`ArcSwap`], and
//! reloaded without a restart when the directory changes.
//!
//! Secret volumes are updated by swapping a `..data` symlink, so the directory (not the file paths)
//! is watched with `notify`, and re-checked periodically as a fallback. A reload happens only when the
//! files' contents changed; an unusable pair (half-written, unparsable, key not matching the
//! certificate) is logged and counted, and the previous certificate stays in service. New handshakes
//! get the new certificate; established connections keep theirs.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use rustls::ServerConfig;
use rustls::crypto::CryptoProvider;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::metrics::{Metrics, ReloadResult};

/// Certificate chain file name in the directory (PEM, leaf first).
pub const CERT_FILE: &str = "tls.crt";
/// Private key file name in the directory (PEM: PKCS#1, PKCS#8 or SEC1).
pub const KEY_FILE: &str = "tls.key";
/// The CA certificate file beside them (the chart's Secret has one; replicas trust each other's
/// certificates it issued).
pub const CA_FILE: &str = "ca.crt";

/// Install rustls' ring provider as the process default (once; later calls are no-ops).
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The process's crypto provider (ring when none is installed).
pub(crate) fn provider() -> Arc<CryptoProvider> {
    CryptoProvider::get_default()
        .cloned()
        .unwrap_or_else(|| Arc::new(rustls::crypto::ring::default_provider()))
}

/// A loaded, checked certificate/key pair.
#[derive(Debug, Clone)]
pub struct LoadedPair {
    /// Chain and signing key, as served.
    pub key: Arc<CertifiedKey>,
    /// The leaf's notAfter, Unix seconds.
    pub not_after: i64,
    /// The leaf's subject, for logs.
    pub subject: String,
}

/// The raw bytes of both files, to notice changes.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Contents {
    cert: Vec<u8>,
    key: Vec<u8>,
}

fn read_contents(dir: &Path) -> Result<(Contents, PathBuf, PathBuf)> {
    let (cert_path, key_path) = (dir.join(CERT_FILE), dir.join(KEY_FILE));
    let read = |what, path: &Path| {
        std::fs::read(path).map_err(|source| Error::TlsRead {
            what,
            path: path.to_path_buf(),
            source,
        })
    };
    let (cert, key) = (
        read("certificate", &cert_path)?,
        read("private key", &key_path)?,
    );
    Ok((Contents { cert, key }, cert_path, key_path))
}

fn parse_pair(c: &Contents, cert_path: &Path, key_path: &Path) -> Result<LoadedPair> {
    let invalid = |what, path: &Path, reason: String| Error::TlsInvalid {
        what,
        path: path.to_path_buf(),
        reason,
    };
    let bad_cert = |reason| invalid("certificate", cert_path, reason);
    let bad_key = |reason| invalid("private key", key_path, reason);
    let chain = CertificateDer::pem_slice_iter(&c.cert)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| bad_cert(format!("not valid PEM: {e}")))?;
    let Some(leaf) = chain.first() else {
        return Err(bad_cert(
            "no CERTIFICATE PEM block found (empty or half-written file?)".into(),
        ));
    };
    let (_, parsed) = x509_parser::parse_x509_certificate(leaf)
        .map_err(|e| bad_cert(format!("the first certificate is not valid X.509: {e}")))?;
    let not_after = parsed.validity().not_after.timestamp();
    let subject = parsed.subject().to_string();
    let key_der = PrivateKeyDer::from_pem_slice(&c.key).map_err(|e| {
        bad_key(match e {
            rustls_pki_types::pem::Error::NoItemsFound => {
                "no PRIVATE KEY, RSA PRIVATE KEY or EC PRIVATE KEY PEM block found (empty or half-written file?)"
                    .to_string()
            }
            other => format!("not valid PEM: {other}"),
        })
    })?;
    let signing_key = provider()
        .key_provider
        .load_private_key(key_der)
        .map_err(|e| bad_key(format!("unsupported or corrupt key: {e}")))?;
    let certified = CertifiedKey::new(chain, signing_key);
    match certified.keys_match() {
        Ok(()) | Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => {}
        Err(e) => {
            return Err(Error::TlsKeyMismatch {
                cert: cert_path.to_path_buf(),
                key: key_path.to_path_buf(),
                reason: e.to_string(),
            });
        }
    }
    Ok(LoadedPair {
        key: Arc::new(certified),
        not_after,
        subject,
    })
}

/// Load and check the pair in `dir` (`tls.crt`, `tls.key`). Errors name the file and the problem.
pub fn load_pair(dir: &Path) -> Result<LoadedPair> {
    let (contents, cert_path, key_path) = read_contents(dir)?;
    parse_pair(&contents, &cert_path, &key_path)
}

/// The certificate currently served. New TLS handshakes read it; swapping it does not disturb
/// established connections.
#[derive(Debug)]
pub struct CertStore {
    current: ArcSwap<CertifiedKey>,
}

impl CertStore {
    /// A store serving `key`.
    pub fn new(key: Arc<CertifiedKey>) -> Self {
        CertStore {
            current: ArcSwap::new(key),
        }
    }

    /// The certificate served to the next handshake.
    pub fn current(&self) -> Arc<CertifiedKey> {
        self.current.load_full()
    }

    fn swap(&self, key: Arc<CertifiedKey>) {
        self.current.store(key);
    }
}

impl ResolvesServerCert for CertStore {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.load_full())
    }
}

/// A rustls server configuration (TLS 1.2 and 1.3, ring, ALPN `h2` and `http/1.1`) serving the
/// store's certificate.
pub fn server_config(store: Arc<CertStore>) -> Result<Arc<ServerConfig>> {
    let mut cfg = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| Error::TlsConfig(e.to_string()))?
        .with_no_client_auth()
        .with_cert_resolver(store);
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// What a reload check did.
#[derive(Debug)]
pub enum ReloadOutcome {
    /// The files are as last seen.
    Unchanged,
    /// A new pair is served.
    Reloaded {
        /// The new leaf's notAfter, Unix seconds.
        not_after: i64,
    },
    /// The files changed but are unusable; the previous pair stays in service.
    Failed(Error),
}

/// Reloads the pair in a directory into a [`CertStore`] when the files change.
#[derive(Debug)]
pub struct CertReloader {
    dir: PathBuf,
    store: Arc<CertStore>,
    metrics: Arc<Metrics>,
    last_seen: Mutex<Option<Contents>>,
}

impl CertReloader {
    /// Load the pair in `dir` (failing with a clear error if it is unusable) and return the reloader
    /// and the store serving it.
    pub fn load(dir: &Path, metrics: Arc<Metrics>) -> Result<(Arc<CertReloader>, Arc<CertStore>)> {
        let (contents, cert_path, key_path) = read_contents(dir)?;
        let pair = parse_pair(&contents, &cert_path, &key_path)?;
        metrics.set_cert_expiry(pair.not_after);
        warn_if_expiring(&cert_path, pair.not_after);
        tracing::info!(dir = %dir.display(), subject = %pair.subject, not_after = pair.not_after, "serving certificate loaded");
        let store = Arc::new(CertStore::new(pair.key));
        let reloader = Arc::new(CertReloader {
            dir: dir.to_path_buf(),
            store: store.clone(),
            metrics,
            last_seen: Mutex::new(Some(contents)),
        });
        Ok((reloader, store))
    }

    /// Re-read the files; swap in the new pair if they changed and are usable.
    pub fn reload(&self) -> ReloadOutcome {
        let (contents, cert_path, key_path) = match read_contents(&self.dir) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "cannot re-read the serving certificate; keeping the current one");
                self.metrics.cert_reload(ReloadResult::Failed);
                return ReloadOutcome::Failed(e);
            }
        };
        let mut last = self.last_seen.lock().unwrap_or_else(|e| e.into_inner());
        if last.as_ref() == Some(&contents) {
            return ReloadOutcome::Unchanged;
        }
        let parsed = parse_pair(&contents, &cert_path, &key_path);
        // Remember these contents either way: an unusable pair is reported once, not on every check.
        *last = Some(contents);
        drop(last);
        match parsed {
            Ok(pair) => {
                self.store.swap(pair.key);
                self.metrics.cert_reload(ReloadResult::Ok);
                self.metrics.set_cert_expiry(pair.not_after);
                warn_if_expiring(&cert_path, pair.not_after);
                tracing::info!(dir = %self.dir.display(), subject = %pair.subject, not_after = pair.not_after, "serving certificate reloaded");
                ReloadOutcome::Reloaded {
                    not_after: pair.not_after,
                }
            }
            Err(e) => {
                self.metrics.cert_reload(ReloadResult::Failed);
                tracing::warn!(error = %e, "new serving certificate is unusable; keeping the current one");
                ReloadOutcome::Failed(e)
            }
        }
    }

    /// Start watching the directory. Called before the server accepts connections, so that every
    /// rotation after start-up wakes [`CertReloader::run`]. A failure to set up the watch is logged;
    /// the periodic check still picks rotations up.
    pub fn watch(&self, interval: Duration) -> CertWatch {
        let (tx, rx) = mpsc::channel::<()>(1);
        let watcher = match watch_dir(&self.dir, tx) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!(error = %e, interval_s = interval.as_secs_f64(), "falling back to periodic certificate checks only");
                None
            }
        };
        CertWatch {
            _watcher: watcher,
            events: rx,
        }
    }

    /// Re-check on every directory event from `watch` and every `interval` until `shutdown`. The
    /// first check runs at once: it covers a rotation between [`CertReloader::load`] and the watch.
    pub async fn run(
        self: Arc<Self>,
        watch: CertWatch,
        interval: Duration,
        shutdown: CancellationToken,
    ) {
        let CertWatch {
            _watcher: watcher,
            events: mut rx,
        } = watch;
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                Some(()) = rx.recv() => {
                    // A rotation is a burst of events (new dir, symlink swap, old dir removed):
                    // let it settle, then check once.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    while rx.try_recv().is_ok() {}
                }
                _ = tick.tick() => {}
            }
            let this = self.clone();
            if let Err(e) = tokio::task::spawn_blocking(move || this.reload()).await {
                tracing::error!(error = %e, "certificate reload task failed");
            }
        }
        drop(watcher);
    }
}

/// A live watch on the certificate directory ([`CertReloader::watch`]); consumed by
/// [`CertReloader::run`].
#[derive(Debug)]
pub struct CertWatch {
    _watcher: Option<notify::RecommendedWatcher>,
    events: mpsc::Receiver<()>,
}

fn watch_dir(dir: &Path, tx: mpsc::Sender<()>) -> Result<notify::RecommendedWatcher> {
    use notify::Watcher as _;
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        if res.is_ok() {
            // A full channel already holds a pending wake-up: that is enough.
            let _ = tx.try_send(());
        }
    })
    .map_err(|source| Error::CertWatch {
        path: dir.to_path_buf(),
        source,
    })?;
    watcher
        .watch(dir, notify::RecursiveMode::NonRecursive)
        .map_err(|source| Error::CertWatch {
            path: dir.to_path_buf(),
            source,
        })?;
    Ok(watcher)
}

fn warn_if_expiring(cert_path: &Path, not_after: i64) {
    let now = jiff::Timestamp::now().as_second();
    if not_after <= now {
        tracing::warn!(path = %cert_path.display(), not_after, "serving certificate has expired; the API server will refuse it");
    } else if not_after - now < 7 * 86_400 {
        tracing::warn!(path = %cert_path.display(), not_after, "serving certificate expires within 7 days");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_pair(dir: &Path, cert: &str, key: &str) {
        std::fs::write(dir.join(CERT_FILE), cert).expect("write cert");
        std::fs::write(dir.join(KEY_FILE), key).expect("write key");
    }

    fn leaf() -> teeguard_certs::ServingCert {
        let ca = teeguard_certs::CertificateAuthority::generate("test-ca", 30).expect("ca");
        ca.issue(&teeguard_certs::ServingCertRequest::localhost())
            .expect("leaf")
    }

    /// A directory holding a good pair, loaded: the directory, its pair, the reloader and its store.
    fn loaded() -> (
        tempfile::TempDir,
        teeguard_certs::ServingCert,
        Arc<CertReloader>,
        Arc<CertStore>,
    ) {
        install_crypto_provider();
        let dir = tempfile::tempdir().expect("tempdir");
        let first = leaf();
        write_pair(dir.path(), first.cert_pem(), first.key_pem());
        let metrics = Arc::new(Metrics::new(&mut Default::default()));
        let (reloader, store) = CertReloader::load(dir.path(), metrics).expect("load");
        (dir, first, reloader, store)
    }

    #[test]
    fn errors_name_the_file_and_problem() {
        install_crypto_provider();
        let dir = tempfile::tempdir().expect("tempdir");
        let err = load_pair(dir.path()).expect_err("missing").to_string();
        assert!(
            err.contains("tls.crt") && err.contains("certificate"),
            "{err}"
        );

        let l = leaf();
        write_pair(dir.path(), "", l.key_pem());
        let err = load_pair(dir.path()).expect_err("empty").to_string();
        assert!(
            err.contains("tls.crt") && err.contains("no CERTIFICATE"),
            "{err}"
        );

        write_pair(dir.path(), l.cert_pem(), "");
        let err = load_pair(dir.path()).expect_err("empty key").to_string();
        assert!(
            err.contains("tls.key") && err.contains("no PRIVATE KEY"),
            "{err}"
        );

        let truncated = &l.cert_pem()[..l.cert_pem().len() / 2];
        write_pair(dir.path(), truncated, l.key_pem());
        let err = load_pair(dir.path()).expect_err("truncated").to_string();
        assert!(err.contains("tls.crt"), "{err}");

        let garbage = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        write_pair(dir.path(), garbage, l.key_pem());
        let err = load_pair(dir.path()).expect_err("garbage").to_string();
        assert!(err.contains("tls.crt") && err.contains("X.509"), "{err}");

        let other = leaf();
        write_pair(dir.path(), l.cert_pem(), other.key_pem());
        let err = load_pair(dir.path()).expect_err("mismatch").to_string();
        assert!(
            err.contains("does not match") && err.contains("tls.key"),
            "{err}"
        );

        write_pair(dir.path(), l.cert_pem(), l.key_pem());
        let pair = load_pair(dir.path()).expect("good pair");
        assert!(pair.not_after > jiff::Timestamp::now().as_second());
    }

    /// The watch is live when `watch` returns, before any task runs: a rotation right after start-up
    /// (the server already accepting) wakes the reloader, not the next periodic check.
    #[tokio::test(flavor = "current_thread")]
    async fn the_directory_watch_is_live_when_watch_returns() {
        let (dir, _, reloader, _) = loaded();
        let mut watch = reloader.watch(Duration::from_secs(3600));
        let second = leaf();
        write_pair(dir.path(), second.cert_pem(), second.key_pem());
        // inotify delivers on its own thread; a loaded machine may take a while, never forever.
        tokio::time::timeout(teeguard_tests::wait::PATIENCE, watch.events.recv())
            .await
            .expect("a directory event for the rotation")
            .expect("the watch's channel is open");
    }

    /// A rotation between `load` and `watch` (no event will come for it) is picked up by `run`'s
    /// first check, not left to the periodic one an hour later.
    #[tokio::test(flavor = "current_thread")]
    async fn a_rotation_before_the_watch_is_picked_up_by_the_first_check() {
        let (dir, _, reloader, store) = loaded();
        let second = leaf();
        write_pair(dir.path(), second.cert_pem(), second.key_pem());
        let hour = Duration::from_secs(3600);
        let watch = reloader.watch(hour);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(reloader.run(watch, hour, shutdown.clone()));
        teeguard_tests::wait::eventually("the rotated certificate served", async || {
            store.current().cert[0] == second.cert_der()
        })
        .await;
        shutdown.cancel();
        task.await.expect("the reloader stops");
    }

    #[test]
    fn reload_only_on_change_and_keeps_old_on_failure() {
        let (dir, first, reloader, store) = loaded();
        let served = |s: &CertStore| s.current().cert[0].clone();
        assert_eq!(served(&store), first.cert_der());
        assert!(matches!(reloader.reload(), ReloadOutcome::Unchanged));

        let second = leaf();
        write_pair(dir.path(), second.cert_pem(), first.key_pem());
        assert!(matches!(
            reloader.reload(),
            ReloadOutcome::Failed(Error::TlsKeyMismatch { .. })
        ));
        assert_eq!(served(&store), first.cert_der());
        // The same bad contents are not re-reported.
        assert!(matches!(reloader.reload(), ReloadOutcome::Unchanged));

        write_pair(dir.path(), second.cert_pem(), second.key_pem());
        assert!(matches!(reloader.reload(), ReloadOutcome::Reloaded { .. }));
        assert_eq!(served(&store), second.cert_der());
    }
}
