//! One booted guest: QEMU started the way the kit's `run.sh` starts it (the kit's kernel as a PVH
//! `vmlinux`, its initramfs, the 9p share its `/init` mounts on `/host` and runs `/host/cmd.sh` from),
//! with a session script as `cmd.sh` that runs the host's requests until told to stop. QEMU is started
//! here rather than through `run.sh` because the session outlives one script, and because `run.sh` has
//! no network (`-nic none`) while the agent's tests need one forward to the API server.
//!
//! Requests are files: the host writes `q/<n>.sh` (renamed into place), the guest runs them in order
//! and writes `q/<n>.out` and then `q/<n>.rc`; the host waits for the `.rc` file, the guest's own
//! signal. Background processes write `p/<name>.log`, read live.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{API_ADDRESS, KIT, Kernel, Kit, image_root};
use crate::{Error, Result};

/// Longest a guest may take to boot and run the session script (TCG on a busy 2-core machine).
pub const BOOT_DEADLINE: Duration = Duration::from_secs(180);
/// Longest one request may take (a hang guard; requests wait on the guest's answer).
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(240);
/// How long a KVM boot may take to reach the guest's `/init` before TCG is used instead (the kit's
/// `TEEVM_KVM_PROBE` default): a KVM that accepts the VM but never runs the kernel has been seen.
const KVM_PROBE: Duration = Duration::from_secs(20);

/// The session: network set-up, the payload copied into the root, then the host's requests in order
/// until `q/stop` exists.
const SESSION: &str = r#"# teeguard tee-vm session (tests/src/teevm): runs the host's requests q/<n>.sh in order
Q=/host/q
if [ -e /host/net ]; then
	modprobe virtio_net 2>/dev/null
	ip link set lo up && ip link set eth0 up && ip addr add 10.0.2.15/24 dev eth0 ||
		echo "TEEGUARD: network set-up failed"
fi
if [ -d /host/root ]; then cp -a /host/root/. / || echo "TEEGUARD: cannot copy the payload"; fi
mkdir -p /host/p
echo "$(uname -r)" >$Q/ready.tmp && mv $Q/ready.tmp $Q/ready
echo "TEEGUARD: session ready"
n=1
while :; do
	if [ -e $Q/$n.sh ]; then
		sh $Q/$n.sh >$Q/$n.out 2>&1 </dev/null
		echo $? >$Q/$n.rc.tmp && mv $Q/$n.rc.tmp $Q/$n.rc
		n=$((n + 1))
		continue
	fi
	[ -e $Q/stop ] && break
	sleep 0.02
done
echo "TEEGUARD: session done"
"#;

/// Runs QEMU (`$2...`) until the test process (`$1`) exits or QEMU does, then stops it.
const WATCHDOG: &str = r#"
parent=$1; shift
"$@" </dev/null >/dev/null 2>&1 &
child=$!
trap 'kill "$child" 2>/dev/null; wait "$child"; exit 0' TERM INT
while kill -0 "$parent" 2>/dev/null && kill -0 "$child" 2>/dev/null; do sleep 0.5; done
kill "$child" 2>/dev/null
wait "$child"
"#;

/// What a guest gets besides the kit's initramfs.
#[derive(Clone, Debug, Default)]
pub struct GuestOptions {
    /// The release `teeguard-agent` and the libraries it links, as `/usr/local/bin/teeguard-agent`.
    pub agent: bool,
    /// The kit's runc (Debian's, with libseccomp) as `/usr/sbin/runc`.
    pub runc: bool,
    /// Forward [`API_ADDRESS`] in the guest to this port on the host's 127.0.0.1.
    pub forward_to: Option<u16>,
}

/// What a request printed (stdout and stderr together) and its exit status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Output {
    /// Exit status of the request's shell.
    pub status: i32,
    /// Its output.
    pub text: String,
}

/// A background process started in the guest.
#[derive(Clone, Debug)]
pub struct Spawned {
    /// Its name (the log's name).
    pub name: String,
    /// Its PID in the guest.
    pub pid: u32,
    /// Its output so far, in the share.
    pub log: PathBuf,
}

impl Spawned {
    /// Its output so far.
    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Wait until its output has a line for which `found` answers; `None` after `timeout`.
    pub async fn wait_line<T>(
        &self,
        timeout: Duration,
        mut found: impl FnMut(&str) -> Option<T>,
    ) -> Option<T> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(t) = self.output().lines().find_map(&mut found) {
                return Some(t);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Which accelerator boots this kit here: `None` until a KVM boot was tried.
static ACCEL: Mutex<Option<&'static str>> = Mutex::new(None);

/// A running guest; stopped (QEMU killed if it does not power off) when dropped. A guest dropped
/// while a test panics keeps its share directory (console log, requests, process logs) and says where.
#[derive(Debug)]
pub struct Guest {
    kit: Kit,
    dir: PathBuf,
    share: PathBuf,
    console: PathBuf,
    qemu: Mutex<Option<Child>>,
    next: Mutex<u32>,
    /// The accelerator in use (`kvm` or `tcg`).
    pub accel: &'static str,
    /// How long the boot took, from QEMU's start to the session being ready.
    pub booted_in: Duration,
    /// Whether dropping it removes its directory (not for a boot attempt that is retried).
    cleanup: bool,
}

impl Guest {
    /// Boot a guest of `kit` with `options` and wait until its session runs.
    pub async fn boot(kit: &Kit, options: GuestOptions) -> Result<Guest> {
        let dir = tempfile::Builder::new()
            .prefix(&format!("teeguard-teevm-{}-", kit.kernel.dir_name()))
            .tempdir()
            .map_err(KIT.io("create the guest's directory"))?
            .keep();
        let share = dir.join("share");
        for d in [share.join("q"), share.join("p")] {
            std::fs::create_dir_all(&d).map_err(KIT.io(format!("create {}", d.display())))?;
        }
        std::fs::write(share.join("cmd.sh"), SESSION)
            .map_err(KIT.io("write the session script"))?;
        if options.forward_to.is_some() {
            std::fs::write(share.join("net"), "").map_err(KIT.io("write the network marker"))?;
        }
        let root = share.join("root");
        if options.agent {
            let bins =
                crate::e2e::guest_binaries().map_err(|e| Error::AgentBinary(e.to_string()))?;
            image_root(&bins.agent, &root)?;
        }
        if options.runc {
            copy_tree(&kit.build_file("runc-root"), &root)?;
        }
        let mut accel = match std::env::var("TEEVM_ACCEL").as_deref() {
            Ok("tcg") => "tcg",
            _ if !kvm_usable() => "tcg",
            _ => ACCEL
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .unwrap_or("kvm"),
        };
        loop {
            let started = Instant::now();
            let mut guest = Guest {
                kit: kit.clone(),
                dir: dir.clone(),
                console: dir.join(format!("console-{accel}.log")),
                share: share.clone(),
                qemu: Mutex::new(None),
                next: Mutex::new(1),
                accel,
                booted_in: Duration::ZERO,
                cleanup: true,
            };
            guest.start_qemu(&options)?;
            let probe = (accel == "kvm").then(|| started + KVM_PROBE);
            match guest.wait_ready(started + BOOT_DEADLINE, probe).await {
                Ok(()) => {
                    *ACCEL.lock().unwrap_or_else(|e| e.into_inner()) = Some(accel);
                    guest.booted_in = started.elapsed();
                    return Ok(guest);
                }
                Err(e) if accel == "kvm" => {
                    eprintln!("tee-vm: KVM cannot boot the guest here ({e}); using TCG");
                    guest.cleanup = false;
                    guest.kill();
                    *ACCEL.lock().unwrap_or_else(|e| e.into_inner()) = Some("tcg");
                    accel = "tcg";
                }
                Err(e) => {
                    // Kept for the console log the error names.
                    guest.cleanup = false;
                    return Err(e);
                }
            }
        }
    }

    /// The kernel.
    pub fn kernel(&self) -> Kernel {
        self.kit.kernel
    }

    /// The kit.
    pub fn kit(&self) -> &Kit {
        &self.kit
    }

    /// The share directory (`/host` in the guest).
    pub fn share(&self) -> &Path {
        &self.share
    }

    /// The guest's console so far.
    pub fn console(&self) -> String {
        std::fs::read_to_string(&self.console).unwrap_or_default()
    }

    /// An error about this guest, naming its console log.
    pub fn error(&self, what: impl Into<String>) -> Error {
        Error::Guest {
            kernel: self.kit.kernel,
            what: what.into(),
            console: self.console.clone(),
        }
    }

    fn start_qemu(&self, options: &GuestOptions) -> Result<()> {
        let cpu = if self.accel == "kvm" {
            std::env::var("TEEVM_KVM_CPU").unwrap_or_else(|_| "host".into())
        } else {
            "max".into()
        };
        let mut args: Vec<String> = vec![
            "qemu-system-x86_64".into(),
            "-accel".into(),
            self.accel.into(),
            "-cpu".into(),
            cpu,
            "-m".into(),
            "768M".into(),
            "-smp".into(),
            "1".into(),
            "-nodefaults".into(),
            "-no-user-config".into(),
            "-display".into(),
            "none".into(),
            "-serial".into(),
            format!("file:{}", self.console.display()),
            "-no-reboot".into(),
            "-kernel".into(),
            self.kit.build_file("vmlinux").display().to_string(),
            "-initrd".into(),
            self.kit.build_file("initramfs.cpio").display().to_string(),
            "-append".into(),
            "console=ttyS0 quiet panic=-1 rdinit=/init".into(),
            "-virtfs".into(),
            format!(
                "local,path={},mount_tag=host,security_model=none,id=host",
                self.share.display()
            ),
        ];
        match options.forward_to {
            None => args.extend(["-nic".into(), "none".into()]),
            Some(port) => {
                // One busybox nc per connection (`cmd:`): a chardev target would carry one
                // connection only, and the agent opens several (watches, writes).
                let nc = self.kit.build_file("bb/bin/busybox");
                let (ip, guest_port) = API_ADDRESS.split_once(':').unwrap_or((API_ADDRESS, ""));
                args.extend([
                    "-netdev".into(),
                    format!(
                        "user,id=net0,restrict=on,ipv6=off,guestfwd=tcp:{ip}:{guest_port}-cmd:{} nc 127.0.0.1 {port}",
                        nc.display()
                    ),
                    "-device".into(),
                    "virtio-net-pci,netdev=net0".into(),
                ]);
            }
        }
        std::fs::write(self.dir.join("qemu.args"), args.join("\n"))
            .map_err(KIT.io("write qemu.args"))?;
        let child = Command::new("bash")
            .arg("-c")
            .arg(WATCHDOG)
            .arg("watchdog")
            .arg(std::process::id().to_string())
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(KIT.io("start qemu-system-x86_64 (needs bash)"))?;
        *self.qemu.lock().unwrap_or_else(|e| e.into_inner()) = Some(child);
        Ok(())
    }

    /// Whether QEMU still runs.
    pub fn running(&self) -> bool {
        self.qemu
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    async fn wait_ready(&self, deadline: Instant, kvm_probe: Option<Instant>) -> Result<()> {
        let ready = self.share.join("q/ready");
        loop {
            if let Ok(release) = std::fs::read_to_string(&ready) {
                if release.trim() != self.kit.kver {
                    return Err(self.error(format!(
                        "booted kernel {:?}, expected {}",
                        release.trim(),
                        self.kit.kver
                    )));
                }
                return Ok(());
            }
            if !self.running() {
                return Err(self.error("QEMU exited before the session started"));
            }
            if kvm_probe.is_some_and(|p| Instant::now() >= p)
                && !self.console().contains("TEEVM: init start")
            {
                return Err(self.error(format!("no init within {KVM_PROBE:?}")));
            }
            if Instant::now() >= deadline {
                return Err(self.error(format!(
                    "the session did not start within {BOOT_DEADLINE:?}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Run `script` (busybox sh) in the guest and wait for it.
    pub async fn run(&self, script: &str) -> Result<Output> {
        let n = {
            let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
            let n = *next;
            let q = self.share.join("q");
            let tmp = q.join(format!(".{n}.sh"));
            std::fs::write(&tmp, script).map_err(KIT.io(format!("write {}", tmp.display())))?;
            std::fs::rename(&tmp, q.join(format!("{n}.sh"))).map_err(KIT.io("queue a request"))?;
            *next += 1;
            n
        };
        let rc = self.share.join(format!("q/{n}.rc"));
        let deadline = Instant::now() + REQUEST_DEADLINE;
        loop {
            if let Ok(text) = std::fs::read_to_string(&rc) {
                let status = text.trim().parse().map_err(|_| {
                    self.error(format!("request {n}: status {text:?} is not a number"))
                })?;
                let text = std::fs::read_to_string(self.share.join(format!("q/{n}.out")))
                    .unwrap_or_default();
                return Ok(Output { status, text });
            }
            if !self.running() {
                return Err(self.error(format!("QEMU exited before request {n} finished")));
            }
            if Instant::now() >= deadline {
                return Err(self.error(format!(
                    "request {n} did not finish within {REQUEST_DEADLINE:?}: {script}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Run `script` and return its output; an error when it exits with another status than 0.
    pub async fn sh(&self, script: &str) -> Result<String> {
        let out = self.run(script).await?;
        if out.status != 0 {
            return Err(self.error(format!(
                "request failed with status {}: {script}\n{}",
                out.status, out.text
            )));
        }
        Ok(out.text)
    }

    /// Start `script` in the background (its own `sh`; end it with `exec` for the PID to be that of
    /// the program it runs) with its output in `p/<name>.log`.
    pub async fn spawn(&self, name: &str, script: &str) -> Result<Spawned> {
        let file = self.share.join("p").join(format!("{name}.sh"));
        std::fs::write(&file, script).map_err(KIT.io(format!("write {}", file.display())))?;
        let out = self
            .sh(&format!(
                "sh /host/p/{name}.sh >/host/p/{name}.log 2>&1 </dev/null &\necho $!"
            ))
            .await?;
        let pid = out
            .trim()
            .parse()
            .map_err(|_| self.error(format!("spawn {name}: no PID in {out:?}")))?;
        Ok(Spawned {
            name: name.to_string(),
            pid,
            log: self.share.join("p").join(format!("{name}.log")),
        })
    }

    /// End the session: the guest powers off; QEMU is killed if it has not exited within 30 s.
    pub async fn stop(self) -> Result<()> {
        std::fs::write(self.share.join("q/stop"), "").map_err(KIT.io("write the stop marker"))?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.running() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    fn kill(&self) {
        if let Some(mut child) = self.qemu.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = Command::new("kill").arg(child.id().to_string()).status();
            let deadline = Instant::now() + Duration::from_secs(10);
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        self.kill();
        if !self.cleanup {
            return;
        }
        if std::thread::panicking() {
            eprintln!(
                "tee-vm ({}): a test failed; the guest's console, requests and process logs are kept in {}",
                self.kit.kernel,
                self.dir.display()
            );
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Whether `/dev/kvm` can be opened for reading and writing.
fn kvm_usable() -> bool {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok()
}

/// `cp -a src/. dest/`.
fn copy_tree(src: &Path, dest: &Path) -> Result<()> {
    std::fs::create_dir_all(dest).map_err(KIT.io(format!("create {}", dest.display())))?;
    let status = Command::new("cp")
        .arg("-a")
        .arg(format!("{}/.", src.display()))
        .arg(dest)
        .status()
        .map_err(KIT.io("run cp"))?;
    if !status.success() {
        return Err(KIT.io(format!(
            "copy {} to {}",
            src.display(),
            dest.display()
        ))(std::io::Error::other(format!(
            "cp exited with {status}"
        ))));
    }
    Ok(())
}
