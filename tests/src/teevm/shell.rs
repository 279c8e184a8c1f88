//! What the kernel tests do in a guest, as small busybox scripts: load `fake_tee` with capacities,
//! create cgroups the way the kubelet lays them out (enabling the misc controller down the path, as a
//! delegating init does), start and stop "VMs" (`holdkeys`, joining a cgroup before it asks for keys,
//! like QEMU started in a pod's container) and read the kernel's files.

use std::time::Duration;

use super::{Guest, Result, Spawned};

/// The guest's cgroup v2 mount.
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// `fake_tee`'s parameters: `sev`, `sev_es` (the capacities, writable) and `usage` (the root's usage,
/// `misc_cg_res_total_usage()`: the only place Linux 6.1 shows it).
pub const FAKE_TEE_PARAMS: &str = "/sys/module/fake_tee/parameters";

/// How long a VM may take to ask for its keys (a process start under TCG on a busy machine).
const VM_START: Duration = Duration::from_secs(60);

/// A VM (`holdkeys … hold`) running in a cgroup, with the kernel's answer to each key it asked for.
#[derive(Clone, Debug)]
pub struct Vm {
    /// The process.
    pub process: Spawned,
    /// The cgroup it runs in, relative to the cgroup root (`""`: the root cgroup).
    pub cgroup: String,
    /// The kind it asked for (`sev`, `sev_es`).
    pub kind: String,
    /// The kernel's answer per key: `ok`, or `refused: EBUSY (…)`.
    pub answers: Vec<String>,
}

impl Vm {
    /// How many keys it holds.
    pub fn granted(&self) -> usize {
        self.answers.iter().filter(|a| *a == "ok").count()
    }

    /// The refusals' errno names (`EBUSY`, `EINVAL`).
    pub fn refused(&self) -> Vec<String> {
        self.answers
            .iter()
            .filter_map(|a| a.strip_prefix("refused: "))
            .map(|r| r.split_whitespace().next().unwrap_or("").to_string())
            .collect()
    }
}

/// The kernel's answers in `holdkeys` output (`key N (kind): ok` / `refused: …`), in order.
pub fn answers(output: &str) -> Vec<String> {
    output
        .lines()
        .filter_map(|l| l.split_once("): ").map(|(_, a)| a.to_string()))
        .filter(|a| a == "ok" || a.starts_with("refused: "))
        .collect()
}

/// Parse a misc file (`name value` lines) into `(name, value)` pairs, `max` kept as text.
pub fn misc_lines(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|l| {
            let mut p = l.split_whitespace();
            Some((p.next()?.to_string(), p.next()?.to_string()))
        })
        .collect()
}

/// The value of `name` in a misc file's text, as a number (`None`: no line, or not a number).
pub fn misc_value(text: &str, name: &str) -> Option<u64> {
    misc_lines(text)
        .into_iter()
        .find(|(n, _)| n == name)
        .and_then(|(_, v)| v.parse().ok())
}

/// Quote `s` for the guest's shell.
pub fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

fn cgroup_dir(rel: &str) -> String {
    if rel.is_empty() {
        CGROUP_ROOT.to_string()
    } else {
        format!("{CGROUP_ROOT}/{rel}")
    }
}

impl Guest {
    /// `insmod fake_tee.ko sev=<sev> sev_es=<sev_es>`: the root's `misc.capacity`.
    pub async fn load_fake_tee(&self, sev: u64, sev_es: u64) -> Result<()> {
        self.sh(&format!(
            "insmod /opt/tee/fake_tee.ko sev={sev} sev_es={sev_es}"
        ))
        .await
        .map(drop)
    }

    /// Change a capacity (`sev` or `sev_es`) through `fake_tee`'s parameter, as firmware or a module
    /// reload would change what KVM sets.
    pub async fn set_capacity(&self, kind: &str, n: u64) -> Result<()> {
        self.sh(&format!("echo {n} >{FAKE_TEE_PARAMS}/{kind}"))
            .await
            .map(drop)
    }

    /// `fake_tee`'s `usage` (the root's usage per kind, whatever the cgroup files show).
    pub async fn usage(&self) -> Result<Vec<(String, u64)>> {
        let text = self.read(&format!("{FAKE_TEE_PARAMS}/usage")).await?;
        Ok(misc_lines(&text)
            .into_iter()
            .filter_map(|(k, v)| Some((k, v.parse().ok()?)))
            .collect())
    }

    /// `fake_tee`'s usage of one kind.
    pub async fn usage_of(&self, kind: &str) -> Result<u64> {
        Ok(self
            .usage()
            .await?
            .into_iter()
            .find(|(k, _)| k == kind)
            .map_or(0, |(_, n)| n))
    }

    /// A file's content (`""` when it does not exist).
    pub async fn read(&self, path: &str) -> Result<String> {
        self.sh(&format!("cat {} 2>/dev/null; true", quote(path)))
            .await
    }

    /// A file of a cgroup (relative to the cgroup root), e.g. `read_cgroup("kubepods", "misc.events")`.
    pub async fn read_cgroup(&self, cgroup: &str, file: &str) -> Result<String> {
        self.read(&format!("{}/{file}", cgroup_dir(cgroup))).await
    }

    /// The misc files present in a cgroup, sorted.
    pub async fn misc_files(&self, cgroup: &str) -> Result<Vec<String>> {
        let out = self
            .sh(&format!(
                "cd {} && ls -d misc.* 2>/dev/null; true",
                quote(&cgroup_dir(cgroup))
            ))
            .await?;
        let mut files: Vec<String> = out.split_whitespace().map(String::from).collect();
        files.sort();
        Ok(files)
    }

    /// One `write(2)` of `value` into `path` (`cgwrite`): `ok` or the errno, e.g.
    /// `EINVAL (Invalid argument)`.
    pub async fn write(&self, path: &str, value: &str) -> Result<String> {
        let out = self
            .sh(&format!("cgwrite {} {}", quote(path), quote(value)))
            .await?;
        Ok(out.trim().to_string())
    }

    /// Create cgroup `rel` (and its parents), enabling the misc controller in the root's and every
    /// ancestor's `cgroup.subtree_control` down to it, as a delegating init or the kubelet does.
    pub async fn mkcgroup(&self, rel: &str) -> Result<()> {
        let mut script = String::from("set -e\n");
        let mut dir = CGROUP_ROOT.to_string();
        for part in rel.split('/').filter(|p| !p.is_empty()) {
            script.push_str(&format!(
                "grep -qw misc {d}/cgroup.subtree_control || echo +misc >{d}/cgroup.subtree_control\n",
                d = quote(&dir)
            ));
            dir = format!("{dir}/{part}");
            script.push_str(&format!("mkdir -p {}\n", quote(&dir)));
        }
        self.sh(&script).await.map(drop)
    }

    /// Create cgroup `rel` and its parents *without* enabling the misc controller anywhere (a host
    /// whose init does not delegate it: every charge lands on the root).
    pub async fn mkcgroup_plain(&self, rel: &str) -> Result<()> {
        self.sh(&format!("mkdir -p {}", quote(&cgroup_dir(rel))))
            .await
            .map(drop)
    }

    /// Remove cgroup `rel` (it must hold no process).
    pub async fn rmcgroup(&self, rel: &str) -> Result<()> {
        self.sh(&format!("rmdir {}", quote(&cgroup_dir(rel))))
            .await
            .map(drop)
    }

    /// Remove cgroup `rel` and every cgroup below it (they must hold no process).
    pub async fn rm_cgroup_tree(&self, rel: &str) -> Result<()> {
        self.sh(&format!(
            "d={}\n[ ! -d \"$d\" ] || find \"$d\" -depth -type d -exec rmdir {{}} \\;",
            quote(&cgroup_dir(rel))
        ))
        .await
        .map(drop)
    }

    /// Start a VM in cgroup `cgroup` (`""`: the root cgroup) asking for `n` keys of `kind` and keeping
    /// what it gets; returns once the kernel has answered every key.
    pub async fn start_vm(&self, name: &str, cgroup: &str, kind: &str, n: u32) -> Result<Vm> {
        let process = self
            .spawn(
                name,
                &format!(
                    "echo $$ >{}/cgroup.procs || {{ echo 'TEEGUARD: cannot join the cgroup'; exit 3; }}\n\
                     exec holdkeys {kind} {n} hold\n",
                    quote(&cgroup_dir(cgroup))
                ),
            )
            .await?;
        let waited = process
            .wait_line(VM_START, |l| {
                // `holding`: every key answered; the others: it will not get that far.
                ["holding", "TEEGUARD:", "usage:", ": open "]
                    .iter()
                    .any(|m| l.contains(m))
                    .then_some(())
            })
            .await;
        let output = process.output();
        if waited.is_none() || !output.contains("holding") {
            return Err(self.error(format!("VM {name} in {cgroup:?} did not start: {output:?}")));
        }
        Ok(Vm {
            answers: answers(&output),
            process,
            cgroup: cgroup.to_string(),
            kind: kind.to_string(),
        })
    }

    /// Ask once for one key of `kind` in `cgroup` and give it back at once (`holdkeys` without
    /// `hold`): the kernel's answer (`ok` or `refused: …`).
    pub async fn try_key(&self, cgroup: &str, kind: &str) -> Result<String> {
        let out = self
            .sh(&format!(
                "sh -c 'echo $$ >\"$1/cgroup.procs\" && exec holdkeys {kind} 1' sh {}; true",
                quote(&cgroup_dir(cgroup))
            ))
            .await?;
        answers(&out)
            .into_iter()
            .next()
            .ok_or_else(|| self.error(format!("no answer from holdkeys in {cgroup:?}: {out:?}")))
    }

    /// Stop a VM (SIGTERM) and wait until its process is gone (its keys given back).
    pub async fn stop_vm(&self, vm: &Vm) -> Result<()> {
        self.sh(&format!(
            "kill {pid} 2>/dev/null\nwhile kill -0 {pid} 2>/dev/null; do sleep 0.02; done",
            pid = vm.process.pid
        ))
        .await
        .map(drop)
    }
}
