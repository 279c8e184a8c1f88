//! inotify watches on cgroup directories, for the events the caller names only.
//!
//! The `notify` crate adds `IN_OPEN` to every watch, so each file the scanner opened in a watched
//! cgroup directory queued an event its thread read and dropped (5-7 % of the agent's CPU per poll,
//! docs/records/performance.md); watching with the `inotify` crate's own mask leaves those out.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::io;
use std::path::{Path, PathBuf};

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

    /// Watch `dir` (again: a directory removed and made anew under the same name needs a new watch).
    pub fn watch(&mut self, dir: &Path) -> io::Result<()> {
        let wd = self.watches.add(dir, self.mask)?;
        self.dirs.insert(dir.to_path_buf(), wd);
        Ok(())
    }

    /// Stop watching `dir` (nothing if it was not watched or is gone).
    pub fn unwatch(&mut self, dir: &Path) {
        if let Some(wd) = self.dirs.remove(dir) {
            // Fails only when the kernel dropped the watch already (the directory was removed).
            let _ = self.watches.remove(wd);
        }
    }

    /// Whether `dir` was watched (and not unwatched since).
    pub fn watches(&self, dir: &Path) -> bool {
        self.dirs.contains_key(dir)
    }
}

impl Drop for DirWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}
