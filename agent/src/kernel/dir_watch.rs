//! inotify watches on cgroup directories, for the events the caller names only.
//!
//! The `notify` crate adds `IN_OPEN` to every watch, so each file the scanner opened in a watched
//! cgroup directory queued an event its thread read and dropped (5-7 % of the agent's CPU per poll,
//! docs/records/performance.md); watching with the `inotify` crate's own mask leaves those out.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::io;
use std::path::PathBuf;

use inotify::{EventMask, Inotify, WatchDescriptor, WatchMask, Watches};
use tokio::task::JoinHandle;
use tokio_stream::StreamExt as _;

/// Watches on directories (not recursive) for the events of one mask, handed to a callback by a task
/// that ends when the `DirWatch` is dropped.
#[derive(Debug)]
pub struct DirWatch {
    watches: Watches,
    mask: WatchMask,
    dirs: HashMap<PathBuf, WatchDescriptor>,
    task: JoinHandle<()>,
}

impl DirWatch {
    /// Watch nothing yet; `on_event(name, mask)` gets every event of `mask` on a watched directory
    /// (`name`: the entry in it the event is about, `None` for the directory itself). Outside a Tokio
    /// runtime, an error.
    pub fn new(
        mask: WatchMask,
        mut on_event: impl FnMut(Option<&OsStr>, EventMask) + Send + 'static,
    ) -> io::Result<DirWatch> {
        let runtime = tokio::runtime::Handle::try_current().map_err(io::Error::other)?;
        let mut stream = Inotify::init()?.into_event_stream(vec![0u8; 4096])?;
        let watches = stream.watches();
        let task = runtime.spawn(async move {
            while let Some(event) = stream.next().await {
                match event {
                    Ok(e) => on_event(e.name.as_deref(), e.mask),
                    Err(e) => {
                        tracing::warn!(error = %e, "inotify stopped; changes are noticed at the next poll");
                        return;
                    }
                }
            }
        });
        Ok(DirWatch {
            watches,
            mask,
            dirs: HashMap::new(),
            task,
        })
    }

    /// Whether the directories watched are exactly `dirs` (each once).
    pub fn watching_exactly(&self, dirs: &[PathBuf]) -> bool {
        dirs.len() == self.dirs.len() && dirs.iter().all(|d| self.dirs.contains_key(d))
    }

    /// Watch exactly `dirs`: every other watch is removed, and each of `dirs` is added again, which
    /// costs one syscall and is what keeps a directory removed and made anew under the same name
    /// watched (inotify hands a directory still watched its own watch back, and a new directory a new
    /// one). Returns the directories that could not be watched, with the error.
    pub fn watch_exactly(&mut self, dirs: &[PathBuf]) -> Vec<(PathBuf, io::Error)> {
        let watches = &mut self.watches;
        self.dirs.retain(|dir, wd| {
            let keep = dirs.contains(dir);
            if !keep {
                // Fails only when the kernel dropped the watch already (the directory was removed).
                let _ = watches.remove(wd.clone());
            }
            keep
        });
        let mut failed = Vec::new();
        for dir in dirs {
            match self.watches.add(dir, self.mask) {
                Ok(wd) => {
                    self.dirs.insert(dir.clone(), wd);
                }
                Err(e) => {
                    self.dirs.remove(dir);
                    failed.push((dir.clone(), e));
                }
            }
        }
        failed
    }
}

impl Drop for DirWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::OsString;
    use std::fs;
    use std::time::Duration;

    use tokio::sync::mpsc;

    use super::*;

    /// The next entry an event names (a bound only so that a lost event fails instead of hanging).
    async fn next(rx: &mut mpsc::UnboundedReceiver<OsString>) -> OsString {
        tokio::time::timeout(Duration::from_secs(30), rx.recv())
            .await
            .expect("an inotify event within 30 s")
            .expect("the watch task is running")
    }

    #[tokio::test]
    async fn watch_exactly_watches_a_directory_made_anew_and_drops_the_others() {
        let root = tempfile::tempdir().expect("tempdir");
        let (qos, other) = (root.path().join("qos"), root.path().join("other"));
        fs::create_dir(&qos).expect("mkdir qos");
        fs::create_dir(&other).expect("mkdir other");
        let (tx, mut rx) = mpsc::unbounded_channel();
        // inotify also reports a removed watch (IN_IGNORED, whatever the mask): only CREATE counts.
        let mut w = DirWatch::new(WatchMask::CREATE, move |name, mask| {
            if let Some(name) = name.filter(|_| mask.contains(EventMask::CREATE)) {
                let _ = tx.send(name.to_owned());
            }
        })
        .expect("inotify");
        assert!(w.watch_exactly(std::slice::from_ref(&qos)).is_empty());
        fs::create_dir(qos.join("a")).expect("mkdir a");
        assert_eq!(next(&mut rx).await, "a");

        // Removed and made anew under the same name (a kubelet re-creating a QoS level).
        fs::remove_dir(qos.join("a")).expect("rmdir a");
        fs::remove_dir(&qos).expect("rmdir qos");
        fs::create_dir(&qos).expect("mkdir qos again");
        assert!(w.watch_exactly(std::slice::from_ref(&qos)).is_empty());
        fs::create_dir(qos.join("b")).expect("mkdir b");
        assert_eq!(next(&mut rx).await, "b", "the new directory is watched");

        // No longer wanted: its events stop (one inotify queue keeps order, so "c" would come first).
        assert!(w.watch_exactly(std::slice::from_ref(&other)).is_empty());
        fs::create_dir(qos.join("c")).expect("mkdir c");
        fs::create_dir(other.join("d")).expect("mkdir d");
        assert_eq!(
            next(&mut rx).await,
            "d",
            "the dropped directory is not watched"
        );

        // A directory that cannot be watched is reported.
        let failed = w.watch_exactly(&[root.path().join("missing")]);
        assert_eq!(failed.len(), 1);
        assert_eq!(failed[0].0, root.path().join("missing"));
    }
}
