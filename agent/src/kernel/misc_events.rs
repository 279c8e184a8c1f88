//! Noticing a failed charge at once: inotify watches on the directories holding the host's
//! `misc.events` files (which count failed charges), so the agent re-scans without waiting for its
//! poll. Without inotify, failed charges are noticed at the next poll.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use notify::Watcher;
use tokio::sync::Notify;

use crate::error::Error;

/// inotify watches on the directories holding `misc.events` files.
#[derive(Debug)]
pub struct EventsWatch {
    watcher: Option<notify::RecommendedWatcher>,
    dirs: Vec<PathBuf>,
    notify: Arc<Notify>,
    dirty: Arc<AtomicBool>,
}

impl EventsWatch {
    /// Start the inotify watcher (no directory watched yet; see [`EventsWatch::refresh`]).
    pub fn new() -> Self {
        let notify = Arc::new(Notify::new());
        let dirty = Arc::new(AtomicBool::new(false));
        let watcher = {
            let notify = notify.clone();
            let dirty = dirty.clone();
            notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
                let Ok(ev) = res else { return };
                use notify::EventKind;
                use notify::event::{AccessKind, AccessMode};
                let is_events = ev
                    .paths
                    .iter()
                    .any(|p| p.file_name().is_some_and(|n| n == "misc.events"));
                match ev.kind {
                    EventKind::Modify(_)
                    | EventKind::Create(_)
                    | EventKind::Access(AccessKind::Close(AccessMode::Write))
                        if is_events =>
                    {
                        notify.notify_one()
                    }
                    EventKind::Remove(_) => dirty.store(true, Ordering::Release),
                    _ => {}
                }
            })
        };
        let watcher = match watcher {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!(error = %Error::Watch(e), "misc.events changes will only be noticed by polling");
                None
            }
        };
        EventsWatch {
            watcher,
            dirs: Vec::new(),
            notify,
            dirty,
        }
    }

    /// Notified when a watched `misc.events` file changed (a failed charge).
    pub fn changed(&self) -> Arc<Notify> {
        self.notify.clone()
    }

    /// True (once) when a watched directory was removed since the last call: the watched set is due
    /// for a refresh.
    pub fn take_dirty(&self) -> bool {
        self.dirty.swap(false, Ordering::AcqRel)
    }

    /// Watch exactly `dirs` (the scanner's `events_dirs`), changing only what differs.
    pub fn refresh(&mut self, dirs: Vec<PathBuf>) {
        let Some(w) = self.watcher.as_mut() else {
            return;
        };
        if dirs == self.dirs {
            return;
        }
        for old in &self.dirs {
            if !dirs.contains(old) {
                let _ = w.unwatch(old);
            }
        }
        let mut watched = Vec::with_capacity(dirs.len());
        for d in dirs {
            if self.dirs.contains(&d) {
                watched.push(d);
                continue;
            }
            match w.watch(&d, notify::RecursiveMode::NonRecursive) {
                Ok(()) => watched.push(d),
                Err(e) => {
                    tracing::debug!(dir = %d.display(), error = %e, "cannot watch misc.events")
                }
            }
        }
        tracing::debug!(dirs = ?watched, "watching misc.events");
        self.dirs = watched;
    }
}

impl Default for EventsWatch {
    fn default() -> Self {
        EventsWatch::new()
    }
}
