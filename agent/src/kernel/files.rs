//! Reading the kernel's small cgroup files: whole files with positioned reads into a reused buffer,
//! files kept open and read again, directory listings, and a pod's `misc.current` recorded into the
//! scan (read, unreadable, missing).
//!
//! A file is read with positioned reads from offset 0 (no seek; a read that does not fill the buffer
//! ends the file, so a small file costs one `pread`).

use std::fs::File;
use std::io::ErrorKind;
use std::os::unix::fs::{FileExt as _, MetadataExt as _};
use std::path::{Path, PathBuf};

use crate::decide::cgroup_names::parse_counts;
use crate::decide::host::PodScan;
use crate::error::{Error, Result};

/// Agent mode: open and read `misc.current` in the pod directory `path` (left pointing at the
/// directory) and record what it holds. `Done` carries the file when it was read, to keep open.
pub(super) fn read_pod_file(
    scan: &mut PodScan,
    path: &mut PathBuf,
    buf: &mut Vec<u8>,
    uid: &str,
) -> PodRead {
    path.push("misc.current");
    let result = match File::open(&*path) {
        Ok(file) => match read_from_start(&file, buf) {
            Ok(text) => {
                record_pod(scan, uid, path, text);
                PodRead::Done(Some(file))
            }
            Err(source) => {
                pod_unreadable(scan, path, source);
                PodRead::Done(None)
            }
        },
        Err(e) if e.kind() == ErrorKind::NotFound => {
            path.pop();
            let read = if path.is_dir() {
                scan.not_delegated(format!("pod cgroup {} has no misc.current", path.display()));
                PodRead::NotDelegated
            } else {
                PodRead::Gone
            };
            path.push("misc.current");
            read
        }
        Err(source) => {
            pod_unreadable(scan, path, source);
            PodRead::Done(None)
        }
    };
    path.pop();
    result
}

/// Record the content of a pod's `misc.current` (`path`, named in messages).
pub(super) fn record_pod(scan: &mut PodScan, uid: &str, path: &Path, text: &str) {
    scan.pods_read += 1;
    match parse_counts(path, text) {
        Ok(c) => {
            if !c.is_zero() {
                scan.usage.insert(uid.to_string(), c);
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "pod cgroup misc.current is malformed; treating the pod as holding no key");
            scan.problem(e.to_string());
        }
    }
}

/// Record a pod's `misc.current` (`path`) that could not be read.
fn pod_unreadable(scan: &mut PodScan, path: &Path, source: std::io::Error) {
    scan.pods_read += 1;
    let e = Error::PodCgroupRead {
        path: path.to_path_buf(),
        source,
    };
    tracing::warn!(error = %e, "cannot read a pod cgroup; treating the pod as holding no key");
    scan.problem(e.to_string());
}

/// What reading a pod's `misc.current` by path found.
pub(super) enum PodRead {
    /// Read (and recorded) or reported as a problem; the file, open, when it could be read.
    Done(Option<File>),
    /// The pod cgroup exists without `misc.current`: the controller is not delegated to pods.
    NotDelegated,
    /// No such pod cgroup (there).
    Gone,
}

/// Largest misc/cgroup control file read (real ones are a few lines).
const MAX_FILE_BYTES: usize = 64 * 1024;

/// Bytes asked for per read; any real misc or cgroup control file fits in one.
pub(super) const READ_CHUNK: usize = 512;

/// Open a small file, read it into `buf` and return it as text.
pub(super) fn read_text<'b>(path: &Path, buf: &'b mut Vec<u8>) -> std::io::Result<&'b str> {
    read_from_start(&File::open(path)?, buf)
}

/// Re-read a file kept open (see "Open files" in `kernel::scanner::interest`). `Ok(None)`: the file
/// has no link left (deleted, or replaced by a rename), so its content is stale and it must be opened
/// again by path. The `fstat` is what catches that on regular files; on the kernel's cgroup files a
/// removed cgroup shows as a read error (`ENODEV`) instead.
pub(super) fn reread<'b>(file: &File, buf: &'b mut Vec<u8>) -> std::io::Result<Option<&'b str>> {
    if file.metadata()?.nlink() == 0 {
        return Ok(None);
    }
    read_from_start(file, buf).map(Some)
}

/// Read a whole small file from offset 0 into `buf` with positioned reads (`pread`; the file position
/// is neither used nor moved, so the same open file can be read again the same way).
///
/// A read returning fewer bytes than asked ends the file, without the extra read that would return 0:
/// a kernfs `seq_file` (every cgroup file) renders the whole content at offset 0 and hands out all of
/// it that fits, and a regular file returns a short read only at its end. A full read is followed by
/// the next one at the offset reached, until a read returns 0 or falls short.
fn read_from_start<'b>(file: &File, buf: &'b mut Vec<u8>) -> std::io::Result<&'b str> {
    buf.clear();
    let mut chunk = [0u8; READ_CHUNK];
    loop {
        match file.read_at(&mut chunk, buf.len() as u64) {
            Ok(0) => break,
            Ok(n) => {
                if buf.len() + n > MAX_FILE_BYTES {
                    return Err(std::io::Error::new(
                        ErrorKind::InvalidData,
                        format!("larger than {MAX_FILE_BYTES} bytes: not a misc cgroup file"),
                    ));
                }
                buf.extend_from_slice(&chunk[..n]);
                if n < chunk.len() {
                    break;
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    std::str::from_utf8(buf).map_err(|e| std::io::Error::new(ErrorKind::InvalidData, e))
}

/// The subdirectories of `dir` (entries vanishing while it is listed are skipped, as cgroups come and go).
pub(super) fn list_dirs(dir: &Path) -> Result<Vec<String>> {
    let err = |source| Error::CgroupList {
        path: dir.to_path_buf(),
        source,
    };
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(err)? {
        let entry = match entry {
            Ok(e) => e,
            // An entry vanishing mid-listing is normal for cgroups.
            Err(e) if e.kind() == ErrorKind::NotFound => continue,
            Err(e) => return Err(err(e)),
        };
        if !entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            continue;
        }
        if let Ok(name) = entry.file_name().into_string() {
            out.push(name);
        }
    }
    Ok(out)
}
