//! Noticing a failed charge at once: inotify watches on the directories holding the host's
//! `misc.events` files (which count failed charges), so the agent re-scans without waiting for its
//! poll. Without inotify, failed charges are noticed at the next poll.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use inotify::{EventMask, WatchMask};
use tokio::sync::Notify;

use super::dir_watch::DirWatch;
use crate::error::Error;

/// inotify watches on the directories holding `misc.events` files.
#[derive(Debug)]
pub struct EventsWatch {
    watcher: Option<DirWatch>,
    notify: Arc<Notify>,
    dirty: Arc<AtomicBool>,
}

impl EventsWatch {
    /// Start the inotify watcher (no directory watched yet; see [`EventsWatch::refresh`]).
    pub fn new() -> Self {
        let notify = Arc::new(Notify::new());
        let dirty = Arc::new(AtomicBool::new(false));
        // The kernel reports a changed `misc.events` as IN_MODIFY on its directory (a file written
        // anew or renamed into place, as tests do, as IN_CLOSE_WRITE or IN_MOVED_TO); a removed child
        // or the directory itself means the watched set is due for a refresh.
        let mask = WatchMask::MODIFY
            | WatchMask::CREATE
            | WatchMask::CLOSE_WRITE
            | WatchMask::MOVED_TO
            | WatchMask::DELETE
            | WatchMask::DELETE_SELF;
        let watcher = {
            let notify = notify.clone();
            let dirty = dirty.clone();
            DirWatch::new(mask, move |name, mask| {
                if mask.intersects(EventMask::DELETE | EventMask::DELETE_SELF) {
                    dirty.store(true, Ordering::Release);
                } else if name.is_some_and(|n| n == "misc.events") {
                    notify.notify_one();
                }
            })
        };
        let watcher = match watcher {
            Ok(w) => Some(w),
            Err(e) => {
                let e = Error::Watch {
                    what: "misc.events files",
                    source: e,
                };
                tracing::warn!(error = %e, "misc.events changes will only be noticed by polling");
                None
            }
        };
        EventsWatch {
            watcher,
            notify,
            dirty,
        }
    }

    /// Notified when a watched `misc.events` file changed (a failed charge).
    pub fn changed(&self) -> Arc<Notify> {
        self.notify.clone()
    }

    /// True when a watched directory was removed since the last [`EventsWatch::refresh`]: the
    /// watched set is due for one.
    pub fn dirty(&self) -> bool {
        self.dirty.load(Ordering::Acquire)
    }

    /// Watch exactly `dirs` (the scanner's `events_dirs`).
    /// Unchanged `dirs` are left alone unless one was removed since (it may have been made anew).
    pub fn refresh(&mut self, dirs: Vec<PathBuf>) {
        let Some(w) = self.watcher.as_mut() else {
            return;
        };
        let removed = self.dirty.swap(false, Ordering::AcqRel);
        // A directory that could not be watched is not watched, so it is tried again at the next
        // refresh.
        if w.watching_exactly(&dirs) && !removed {
            return;
        }
        for (d, e) in w.watch_exactly(&dirs) {
            tracing::debug!(dir = %d.display(), error = %e, "cannot watch misc.events");
        }
        tracing::debug!(?dirs, "watching misc.events");
    }
}

impl Default for EventsWatch {
    fn default() -> Self {
        EventsWatch::new()
    }
}
