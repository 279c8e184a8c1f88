//! Stopping a [`super::RealNode`] when its test process exits: `<state>/teardown.sh`, run by a janitor
//! that waits for the test process; the kernel tunables the kubelet sets, saved before the first test
//! node's kubelet starts and put back when the last one stops; keeping the logs of a failed run.

use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::{Command, Stdio};

use super::{KIT, Result, Runtime, run};

/// The tunables a kubelet sets when it starts (`/proc/sys` paths).
const SYSCTLS: [&str; 6] = [
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
];

/// `<state>/sysctls.sh save|restore <id>`: saves or puts back the machine's tunables (`@KEYS@`),
/// machine-wide under a lock: saved when no other test node is running, put back when the last one
/// stops. A node runs while its janitor `<id>` lives: the janitor ends only after its teardown, so a
/// node that the next test binary starts while the previous one is still being torn down (its kubelet's
/// values still set) does not take those values for the machine's.
const SYSCTL_SCRIPT: &str = r#"
set -u
cmd=$1; id=$2
d=/tmp/teeguard-node-sysctls
mkdir -p "$d/users"
exec 9>"$d/lock"
flock 9
others=0
for u in "$d"/users/*; do
  [ -e "$u" ] || continue
  p=$(basename "$u")
  if [ "$p" != "$id" ] && kill -0 "$p" 2>/dev/null; then others=1; else [ "$p" = "$id" ] || rm -f "$u"; fi
done
case "$cmd" in
  save)
    if [ "$others" = 0 ]; then
      : > "$d/original.new"
      for k in @KEYS@; do echo "$k $(cat "/proc/sys/$k")" >> "$d/original.new"; done
      mv "$d/original.new" "$d/original"
    fi
    touch "$d/users/$id" ;;
  restore)
    rm -f "$d/users/$id"
    if [ "$others" = 0 ] && [ -f "$d/original" ]; then
      while read -r k v; do echo "$v" > "/proc/sys/$k"; done < "$d/original"
      rm -f "$d/original"
    fi ;;
esac
"#;

/// `<state>/teardown.sh`; `@DIR@`, `@BIN@`, `@RUNTIME@`, `@CGROUP@`, `@BRIDGE@`, `@ID@` are filled in.
const TEARDOWN: &str = r#"#!/usr/bin/env bash
# Stops the real test node under this directory (its janitor runs this once the test process @ID@ has
# exited; it may be run by hand): the kubelet, the pods (so their cgroups go away), the runtime, then
# whatever of this node is left (shims, conmon, containers: their command lines name this directory, or
# they sit in its cgroups); unmounts what is left under the directory, removes the node's cgroups
# (/sys/fs/cgroup/*/@CGROUP@) and its pod network's bridge (@BRIDGE@), puts the kernel tunables back when no other test node runs, and removes
# the directory, keeping log/ and record/ when a test failed (the FAILED marker).
set -u
dir=@DIR@; bin=@BIN@; runtime=@RUNTIME@; cgroot=@CGROUP@
alive() { [ -e "/proc/$1" ] && [ "$(sed -n 's/^.*) \(.\).*$/\1/p' "/proc/$1/stat" 2>/dev/null)" != Z ]; }
stop() {
  local p
  p=$(cat "$dir/pids/$1" 2>/dev/null) || return 0
  alive "$p" || return 0
  kill "$p" 2>/dev/null
  for _ in $(seq 100); do alive "$p" || return 0; sleep 0.1; done
  kill -9 "$p" 2>/dev/null
}
stop kubelet
sock="$dir/$runtime.sock"
if [ -S "$sock" ] && alive "$(cat "$dir/pids/$runtime" 2>/dev/null)"; then
  C=("$bin/crictl" -r "unix://$sock" -i "unix://$sock" -t 10s)
  for p in $("${C[@]}" pods -q 2>/dev/null); do "${C[@]}" stopp "$p"; "${C[@]}" rmp -f "$p"; done >/dev/null 2>&1
fi
stop "$runtime"
for p in $(grep -lsF "$dir" /proc/[0-9]*/cmdline | cut -d/ -f3); do
  [ "$p" != $$ ] && kill -9 "$p" 2>/dev/null
done
cgroups() { for h in /sys/fs/cgroup/*/"$cgroot" /sys/fs/cgroup/"$cgroot"; do [ -d "$h" ] && echo "$h"; done; }
for h in $(cgroups); do
  for f in $(find "$h" -name cgroup.procs); do for p in $(cat "$f"); do kill -9 "$p" 2>/dev/null; done; done
done
for m in $(awk -v d="$dir" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r); do
  umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null
done
for _ in $(seq 10); do
  for h in $(cgroups); do find "$h" -depth -type d -exec rmdir {} + 2>/dev/null; done
  [ -z "$(cgroups)" ] && break
  sleep 0.5
done
[ -z "$(cgroups)" ] || echo "teardown: cgroups left: $(cgroups)" >&2
ip link del @BRIDGE@ 2>/dev/null
bash "$dir/sysctls.sh" restore $$
if [ -e "$dir/FAILED" ]; then
  find "$dir" -mindepth 1 -maxdepth 1 ! -name log ! -name record ! -name FAILED -exec rm -rf {} +
else
  rm -rf "$dir"
fi
"#;

/// Runs `teardown.sh` once the test process (`$1`) has exited; deaf to the signals of a Ctrl-C.
const JANITOR: &str = r#"
trap '' INT TERM HUP
while kill -0 "$1" 2>/dev/null; do sleep 0.5; done
exec bash "$2/teardown.sh" >"$2/teardown.log" 2>&1
"#;

/// Write `teardown.sh` and `sysctls.sh`, start the janitor, and mark the directory on the first panic
/// so the logs stay.
pub(super) fn install(
    dir: &Path,
    bin: &Path,
    runtime: Runtime,
    cgroup_root: &str,
    bridge: &str,
) -> Result<()> {
    let id = std::process::id().to_string();
    let script = TEARDOWN
        .replace("@DIR@", &dir.display().to_string())
        .replace("@BIN@", &bin.display().to_string())
        .replace("@RUNTIME@", runtime.name())
        .replace("@CGROUP@", cgroup_root)
        .replace("@BRIDGE@", bridge)
        .replace("@ID@", &id);
    let write = |name: &str, body: &str| {
        std::fs::write(dir.join(name), body).map_err(KIT.io(format!("write {name}")))
    };
    write("teardown.sh", &script)?;
    write(
        "sysctls.sh",
        &SYSCTL_SCRIPT.replace("@KEYS@", &SYSCTLS.join(" ")),
    )?;
    let janitor = Command::new("bash")
        .arg("-c")
        .arg(JANITOR)
        .arg("janitor")
        .arg(&id)
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .map_err(KIT.io("start the node's janitor (needs bash)"))?;
    write("pids/janitor", &janitor.id().to_string())?;
    let kept = format!(
        "real node: a test failed; the node's logs are kept in {0}/log, the recorded OCI configs in {0}/record",
        dir.display()
    );
    crate::controlplane::install_panic_hook(dir, kept);
    Ok(())
}

/// Save the machine's kernel tunables before a kubelet changes them (see [`SYSCTL_SCRIPT`]).
pub(super) fn save_sysctls(dir: &Path) -> Result<()> {
    let janitor = std::fs::read_to_string(dir.join("pids/janitor"))
        .map_err(KIT.io("read the janitor's pid"))?;
    let mut cmd = Command::new("bash");
    cmd.arg(dir.join("sysctls.sh"))
        .arg("save")
        .arg(janitor.trim());
    run(cmd, "sysctls.sh save (needs bash and flock)").map(|_| ())
}
