//! Containers in a guest booted with [`super::GuestOptions::runc`]: the kit's runc (Debian's 1.1.5,
//! cgroupfs driver) runs an OCI config ([`super::oci`]) on a small busybox root with `holdkeys`, and
//! the test reads what runc wrote into the container's cgroup and what the kernel answered the VM.

use std::time::Duration;

use serde_json::Value;

use super::shell::{CGROUP_ROOT, Vm, answers, quote};
use super::{Guest, Result};

/// The root every container gets (busybox and `holdkeys`, made once per guest).
const ROOTFS: &str = "/tmp/rootfs";

/// How long runc may take to start a container (TCG on a busy machine).
const START: Duration = Duration::from_secs(90);

/// A container runc started, its VM holding what the kernel gave it.
#[derive(Clone, Debug)]
pub struct Container {
    /// The container's ID (its name).
    pub id: String,
    /// The container's VM (the `runc run` process; its output is the VM's).
    pub vm: Vm,
}

impl Guest {
    /// `/sys/class/misc/fake_tee/dev`'s minor number (after [`Guest::load_fake_tee`]).
    pub async fn fake_tee_minor(&self) -> Result<u32> {
        let dev = self.read("/sys/class/misc/fake_tee/dev").await?;
        dev.trim()
            .split_once(':')
            .and_then(|(_, minor)| minor.parse().ok())
            .ok_or_else(|| self.error(format!("fake_tee's device number is {dev:?}")))
    }

    async fn bundle(&self, id: &str, config: &Value) -> Result<String> {
        let dir = self.share().join("bundles");
        std::fs::create_dir_all(&dir).map_err(super::KIT.io("create bundles/"))?;
        let mut config = config.clone();
        config["root"]["path"] = Value::String(ROOTFS.into());
        std::fs::write(dir.join(format!("{id}.json")), config.to_string())
            .map_err(super::KIT.io("write a bundle's config"))?;
        let bundle = format!("/tmp/bundles/{id}");
        self.sh(&format!(
            "[ -d {ROOTFS} ] || {{ mkdir -p {ROOTFS}/bin {ROOTFS}/proc {ROOTFS}/dev {ROOTFS}/sys {ROOTFS}/tmp && \
             cp /bin/busybox /opt/tee/holdkeys {ROOTFS}/bin/ && ln -s busybox {ROOTFS}/bin/sh; }}\n\
             mkdir -p {bundle} && cp /host/bundles/{id}.json {bundle}/config.json"
        ))
        .await?;
        Ok(bundle)
    }

    /// `runc run` the container `id` with `config` in the background and wait until its VM has its
    /// keys' answers; an error when runc does not start it (see [`Guest::runc_refuses`]).
    pub async fn runc_run(&self, id: &str, config: &Value) -> Result<Container> {
        let bundle = self.bundle(id, config).await?;
        let process = self
            .spawn(
                &format!("runc-{id}"),
                &format!("exec runc --root /run/runc run -b {bundle} {id}\n"),
            )
            .await?;
        let started = process
            .wait_line(START, |l| {
                (l.contains("holding") || l.contains("runc run failed")).then_some(())
            })
            .await;
        let output = process.output();
        if started.is_none() || !output.contains("holding") {
            return Err(self.error(format!("runc did not start container {id}: {output}")));
        }
        let cgroup = config["linux"]["cgroupsPath"]
            .as_str()
            .unwrap_or_default()
            .trim_start_matches('/')
            .to_string();
        let kind = config["process"]["args"][1]
            .as_str()
            .unwrap_or_default()
            .to_string();
        Ok(Container {
            id: id.to_string(),
            vm: Vm {
                answers: answers(&output),
                process,
                cgroup,
                kind,
            },
        })
    }

    /// `runc run` the container `id` with `config` in the foreground, expecting runc to refuse it:
    /// its output (an error when runc started it after all: it is killed first).
    pub async fn runc_refuses(&self, id: &str, config: &Value) -> Result<String> {
        let bundle = self.bundle(id, config).await?;
        let out = self
            .run(&format!(
                "timeout 60 runc --root /run/runc run -b {bundle} {id} </dev/null 2>&1"
            ))
            .await?;
        if out.status == 0 || out.text.contains("holding") {
            let _ = self
                .run(&format!("runc --root /run/runc delete -f {id}"))
                .await;
            return Err(self.error(format!(
                "runc started container {id} (status {}): {}",
                out.status, out.text
            )));
        }
        Ok(out.text)
    }

    /// Stop a container (`runc kill … TERM`) and wait until runc has removed it (and its cgroup).
    pub async fn runc_stop(&self, c: &Container) -> Result<()> {
        self.sh(&format!(
            "runc --root /run/runc kill {id} TERM\n\
             while kill -0 {pid} 2>/dev/null; do sleep 0.02; done\n\
             while [ -d {dir} ]; do sleep 0.02; done",
            id = c.id,
            pid = c.vm.process.pid,
            dir = quote(&format!("{CGROUP_ROOT}/{}", c.vm.cgroup))
        ))
        .await
        .map(drop)
    }
}
