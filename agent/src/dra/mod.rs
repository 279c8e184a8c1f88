//! DRA mode wired together: the kubelet plugin (registration + `DRAPlugin`) on the kubelet's sockets,
//! the checkpoint of prepared claims, and the state the agent's loop and the plugin share (the
//! kernel's latest figures, the claims prepared). The loop publishes the slices (`run::reconcile`).
//!
//! Preparing a claim (the kubelet calls before it starts the pod): read the claim, take this driver's
//! devices from its allocation, check them against the kernel's figures and the other prepared claims
//! (`decide::dra::prepare_check`), record the claim in the checkpoint, answer with the devices. Asked
//! again for a claim it already prepared (kubelet retries, agent restarts), it answers the same without
//! reading anything. Unpreparing forgets the claim; an unknown or deleted claim is already unprepared.
//!
//! The checkpoint is written on the blocking pool, never on the runtime's thread (the agent runs on
//! one: a write waiting on a slow disk would stall the NRI plugin, the loop and every other call), one
//! write at a time, each carrying every change made before it: a claim's devices are taken in memory
//! first, so concurrent prepares see them, and the answer waits until a checkpoint holding the claim
//! is on disk (N concurrent prepares cost a few writes, not N).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kube::Client;
use teeguard_shared::TeeKind;
use teeguard_shared::names::DRA_DRIVER;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::cluster::slices;
use crate::decide::attribution::KindFigures;
use crate::decide::claimed::ClaimedKeys;
use crate::decide::dra::{
    AllocatedDevice, PrepareInput, PreparedClaim, allocated_devices, prepare_check,
};
use crate::error::{Error, Result};
use crate::kubelet::PluginPaths;
use crate::kubelet::checkpoint::Checkpoint;
use crate::kubelet::grpc::{self, DraHandler, DraService, Listening, RegistrationService};
use crate::kubelet::proto::{
    Claim, Device, NodePrepareResourceResponse, NodePrepareResourcesRequest,
    NodePrepareResourcesResponse, NodeUnprepareResourceResponse, NodeUnprepareResourcesRequest,
    NodeUnprepareResourcesResponse, RegistrationStatus,
};
use crate::metrics::Metrics;

/// The running DRA driver.
pub struct Dra {
    shared: Arc<Shared>,
    registration: tokio::sync::watch::Receiver<Option<RegistrationStatus>>,
    /// Stops the plugin's servers (their sockets are removed).
    stop: CancellationToken,
    _servers: [Listening; 2],
}

impl std::fmt::Debug for Dra {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dra")
            .field("node", &self.shared.node)
            .finish_non_exhaustive()
    }
}

/// What [`Dra::start`] needs.
#[derive(Clone, Debug)]
pub struct DraOptions {
    /// This node.
    pub node_name: String,
    /// The kubelet's root directory (`/var/lib/kubelet`).
    pub kubelet_dir: std::path::PathBuf,
    /// Time limit of one API call.
    pub api_timeout: Duration,
}

struct Shared {
    node: String,
    client: Client,
    checkpoint: Checkpoint,
    api_timeout: Duration,
    metrics: Metrics,
    state: Arc<Mutex<State>>,
    /// The generation of the claims last written to the checkpoint; held while writing, so writes
    /// happen one at a time, on the blocking pool.
    written: Arc<Mutex<u64>>,
    /// Notified when a claim is prepared or unprepared (the loop re-publishes).
    changed: Arc<Notify>,
    /// The prepared claims' keys, for enforcement (sent before the kubelet hears back, so the
    /// limits of a pod's containers know its claims when the runtime creates them).
    claimed: tokio::sync::watch::Sender<Arc<ClaimedKeys>>,
    /// Draining ([`Dra::start_draining`]): the node went back to extended-resource accounting with
    /// claims still prepared. The driver prepares nothing new and serves the kubelet's unprepare
    /// calls (a pod allocated a device cannot end until its claim is unprepared) until none is left.
    draining: bool,
}

#[derive(Default)]
struct State {
    claims: BTreeMap<String, PreparedClaim>,
    /// Bumped on every change to `claims`.
    generation: u64,
    /// Claims prepared but not on disk yet, with the generation that added them.
    unsaved: BTreeMap<String, u64>,
    /// Prepared claims none of whose pods is bound to the node, since when.
    orphan_since: BTreeMap<String, Instant>,
    figures: Option<BTreeMap<TeeKind, KindFigures>>,
    claimless: BTreeMap<TeeKind, u64>,
}

impl Dra {
    /// Load the checkpoint and serve the kubelet plugin until `shutdown`. A checkpoint that cannot be
    /// read is moved aside (`.unreadable`) and logged: the kubelet prepares again the claims of pods
    /// that did not start yet, and the running ones keep running.
    pub fn start(
        client: Client,
        opts: DraOptions,
        metrics: Metrics,
        shutdown: CancellationToken,
    ) -> Result<Dra> {
        let paths = PluginPaths::under(&opts.kubelet_dir);
        let checkpoint = Checkpoint::new(&paths.checkpoint);
        let claims = match checkpoint.load() {
            Ok(c) => c,
            Err(e) => {
                let aside = paths.checkpoint.with_extension("json.unreadable");
                let moved = std::fs::rename(&paths.checkpoint, &aside);
                tracing::error!(error = %e, moved_to = %aside.display(), moved = moved.is_ok(), "starting with no prepared claims");
                BTreeMap::new()
            }
        };
        if !claims.is_empty() {
            tracing::info!(
                claims = claims.len(),
                "prepared claims read from the checkpoint"
            );
        }
        Dra::serve(client, opts, metrics, shutdown, checkpoint, claims, false)
    }

    /// Serve the kubelet plugin with `claims` (read from `checkpoint`) prepared, until `shutdown` or
    /// [`Dra::stop`]; `draining`: see [`Shared::draining`].
    fn serve(
        client: Client,
        opts: DraOptions,
        metrics: Metrics,
        shutdown: CancellationToken,
        checkpoint: Checkpoint,
        claims: BTreeMap<String, PreparedClaim>,
        draining: bool,
    ) -> Result<Dra> {
        let shutdown = shutdown.child_token();
        let paths = PluginPaths::under(&opts.kubelet_dir);
        let claimed =
            tokio::sync::watch::Sender::new(Arc::new(ClaimedKeys::from_prepared(claims.values())));
        let shared = Arc::new(Shared {
            node: opts.node_name.clone(),
            client,
            checkpoint,
            api_timeout: opts.api_timeout,
            metrics,
            state: Arc::new(Mutex::new(State {
                claims,
                ..State::default()
            })),
            written: Arc::new(Mutex::new(0)),
            changed: Arc::new(Notify::new()),
            claimed,
            draining,
        });
        // The DRA socket first: the kubelet connects to it as soon as it sees the registration.
        let dra = grpc::serve(
            &paths.dra,
            DraService::new(shared.clone()),
            shutdown.clone(),
        )?;
        let registration_service = RegistrationService::new(DRA_DRIVER, &paths.dra);
        let registration = registration_service.status();
        let reg = grpc::serve(&paths.registration, registration_service, shutdown.clone())?;
        tracing::info!(
            registration = %paths.registration.display(),
            endpoint = %paths.dra.display(),
            driver = DRA_DRIVER,
            draining,
            "serving the kubelet plugin"
        );
        Ok(Dra {
            shared,
            registration,
            stop: shutdown,
            _servers: [dra, reg],
        })
    }

    /// In extended-resource accounting: when the checkpoint still holds claims prepared in DRA mode
    /// (the node was switched back with pods allocated a device still running), serve the kubelet
    /// plugin to unprepare them, draining (see `Shared::draining`); otherwise `None`, nothing is
    /// served. A plugin that cannot be served is logged, not fatal: the agent's work in
    /// extended-resource accounting does not depend on it.
    pub fn start_draining(
        client: Client,
        opts: DraOptions,
        metrics: Metrics,
        shutdown: CancellationToken,
    ) -> Option<Dra> {
        let checkpoint = Checkpoint::new(&PluginPaths::under(&opts.kubelet_dir).checkpoint);
        let claims = match checkpoint.load() {
            Ok(claims) if !claims.is_empty() => claims,
            Ok(_) => return None,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the DRA checkpoint; not serving the kubelet plugin");
                return None;
            }
        };
        tracing::warn!(
            claims = claims.len(),
            "claims prepared in DRA mode are still held: serving the kubelet's unprepare calls until they end (nothing new is prepared)"
        );
        match Dra::serve(client, opts, metrics, shutdown, checkpoint, claims, true) {
            Ok(d) => Some(d),
            Err(e) => {
                tracing::error!(error = %e, "cannot serve the kubelet plugin: the pods allocated a device in DRA mode cannot end until their claims are unprepared (docs/dra.md, switching back)");
                None
            }
        }
    }

    /// No claim is prepared.
    pub fn is_empty(&self) -> bool {
        self.shared.lock().claims.is_empty()
    }

    /// Stop serving the kubelet plugin: the sockets are removed, so the kubelet drops the plugin
    /// (and deletes the driver's ResourceSlices 30 s later).
    pub fn stop(self) {
        self.stop.cancel();
    }

    /// Notified when a claim was prepared or unprepared.
    pub fn changed(&self) -> Arc<Notify> {
        self.shared.changed.clone()
    }

    /// The kubelet's registration verdict (`None` until it called).
    pub fn registration(&self) -> Option<RegistrationStatus> {
        self.registration.borrow().clone()
    }

    /// Tell the plugin the kernel's latest figures and the keys of pods without a claim.
    pub fn observe(
        &self,
        figures: &BTreeMap<TeeKind, KindFigures>,
        claimless: &BTreeMap<TeeKind, u64>,
    ) {
        let mut s = self.shared.lock();
        s.figures = Some(figures.clone());
        s.claimless = claimless.clone();
    }

    /// Devices held by prepared claims, per kind.
    pub fn allocated(&self) -> BTreeMap<TeeKind, BTreeSet<u32>> {
        allocated_devices(self.shared.lock().claims.values())
    }

    /// The prepared claims' keys, kept current (enforcement reads them).
    pub fn claims(&self) -> tokio::sync::watch::Receiver<Arc<ClaimedKeys>> {
        self.shared.claimed.subscribe()
    }

    /// Forget the prepared claims none of whose pods has been bound to the node for `grace` (the
    /// kubelet unprepares a claim when its pod ends; a pod force-deleted while the driver was away
    /// leaves its claim behind, which would hold its devices forever). Returns the claims forgotten.
    pub async fn forget_orphans(
        &self,
        pods_on_node: &std::collections::HashSet<&str>,
        now: Instant,
        grace: Duration,
    ) -> Vec<String> {
        let forget = {
            let mut s = self.shared.lock();
            let orphans: Vec<String> = s
                .claims
                .iter()
                .filter(|(_, c)| !c.pods.iter().any(|p| pods_on_node.contains(p.as_str())))
                .map(|(uid, _)| uid.clone())
                .collect();
            s.orphan_since.retain(|uid, _| orphans.contains(uid));
            let mut forget = Vec::new();
            for uid in orphans {
                let since = *s.orphan_since.entry(uid.clone()).or_insert(now);
                if now.duration_since(since) >= grace {
                    forget.push(uid);
                }
            }
            forget
        };
        if forget.is_empty() {
            return forget;
        }
        let (removed, saved) = self.shared.forget(&forget).await;
        if let Err(e) = saved {
            tracing::warn!(error = %e, "cannot forget prepared claims whose pods are gone");
            return Vec::new();
        }
        let mut s = self.shared.lock();
        for (u, c) in &removed {
            s.orphan_since.remove(u);
            tracing::info!(claim = %format!("{}/{}", c.namespace, c.name), pods = ?c.pods, "forgot a prepared claim: none of its pods is on the node any more");
        }
        removed.into_iter().map(|(u, _)| u).collect()
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain data behind: keep using it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Forget the claims `uids` (those recorded) and save the checkpoint; when it cannot be saved they
    /// stay recorded, so the checkpoint stays the truth. Returns the claims removed and the save's
    /// outcome.
    async fn forget(&self, uids: &[String]) -> (Vec<(String, PreparedClaim)>, Result<()>) {
        let (removed, generation) = {
            let mut s = self.lock();
            let removed: Vec<(String, PreparedClaim)> = uids
                .iter()
                .filter_map(|u| s.claims.remove(u).map(|c| (u.clone(), c)))
                .collect();
            if removed.is_empty() {
                return (removed, Ok(()));
            }
            s.generation += 1;
            (removed, s.generation)
        };
        let undo = {
            let removed = removed.clone();
            move |s: &mut State| {
                for (u, c) in removed {
                    s.claims.entry(u).or_insert(c);
                }
            }
        };
        let saved = self.persist(generation, undo).await;
        if saved.is_ok() {
            self.publish_claims(&self.lock());
        }
        (removed, saved)
    }

    /// Return once a checkpoint holding the claims as they were at `generation` (or later) is on
    /// disk, writing it when no write since did. When this call's own write fails, `undo` takes the
    /// change back before any other write starts, so no later checkpoint holds it either. The write
    /// runs on the blocking pool to its end even when the caller goes away (a gRPC call cancelled),
    /// so two writes never overlap.
    async fn persist(
        &self,
        generation: u64,
        undo: impl FnOnce(&mut State) + Send + 'static,
    ) -> Result<()> {
        let state = self.state.clone();
        let written = self.written.clone();
        let checkpoint = self.checkpoint.clone();
        let write = tokio::task::spawn_blocking(move || {
            let mut written = written.lock().unwrap_or_else(|e| e.into_inner());
            if *written >= generation {
                return Ok(());
            }
            let (claims, at) = {
                let s = state.lock().unwrap_or_else(|e| e.into_inner());
                (s.claims.clone(), s.generation)
            };
            let saved = checkpoint.save(&claims);
            let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
            match saved {
                Ok(()) => {
                    *written = at;
                    s.unsaved.retain(|_, g| *g > at);
                }
                Err(_) => {
                    undo(&mut s);
                    s.generation += 1;
                }
            }
            saved
        });
        write
            .await
            .map_err(|e| Error::Task(format!("writing the DRA checkpoint: {e}")))?
    }

    /// Tell enforcement the claims recorded now.
    fn publish_claims(&self, s: &State) {
        self.claimed
            .send_replace(Arc::new(ClaimedKeys::from_prepared(s.claims.values())));
    }

    fn devices_of(claim: &PreparedClaim) -> Vec<Device> {
        claim
            .devices
            .iter()
            .map(|d| Device {
                request_names: vec![d.request.clone()],
                pool_name: d.pool.clone(),
                device_name: d.device.clone(),
                cdi_device_ids: Vec::new(),
                share_id: None,
            })
            .collect()
    }

    /// Prepare one claim: its devices and the metric's result (`prepared`, or `already` for a claim
    /// prepared before), or why not.
    async fn prepare_one(
        &self,
        claim: &Claim,
    ) -> std::result::Result<(Vec<Device>, &'static str), String> {
        let known = {
            let s = self.lock();
            s.claims
                .get(&claim.uid)
                .map(|p| (Self::devices_of(p), s.unsaved.get(&claim.uid).copied()))
        };
        if let Some((devices, unsaved)) = known {
            // Asked again while the first answer waits for its write: answer once it is on disk.
            if let Some(generation) = unsaved {
                // Its own write undoes it when it fails; nothing to undo here.
                self.persist(generation, |_| ())
                    .await
                    .map_err(|e| e.to_string())?;
                if !self.lock().claims.contains_key(&claim.uid) {
                    return Err(format!(
                        "ResourceClaim {}/{}: the checkpoint could not record it",
                        claim.namespace, claim.name
                    ));
                }
            }
            return Ok((devices, "already"));
        }
        if self.draining {
            return Err(format!(
                "node {} uses extended-resource accounting now (agent.accounting): the driver only \
                 unprepares the claims it prepared before",
                self.node
            ));
        }
        let what = format!("ResourceClaim {}/{}", claim.namespace, claim.name);
        let read = tokio::time::timeout(
            self.api_timeout,
            slices::get_claim(&self.client, &claim.namespace, &claim.name),
        )
        .await
        .map_err(|_| format!("reading {what} timed out after {:?}", self.api_timeout))?
        .map_err(|e| format!("cannot read {what}: {e}"))?;
        let Some(rc) = read else {
            return Err(format!("{what} no longer exists"));
        };
        if rc.metadata.uid.as_deref() != Some(claim.uid.as_str()) {
            return Err(format!(
                "{what} was replaced (UID {:?}, the kubelet asked for {})",
                rc.metadata.uid, claim.uid
            ));
        }
        let status = rc.status.unwrap_or_default();
        let Some(allocation) = status.allocation else {
            return Err(format!("{what} is not allocated"));
        };
        let devices: Vec<AllocatedDevice> = allocation
            .devices
            .and_then(|d| d.results)
            .unwrap_or_default()
            .into_iter()
            .filter(|r| r.driver == DRA_DRIVER)
            .map(|r| AllocatedDevice {
                request: r.request,
                pool: r.pool,
                device: r.device,
            })
            .collect();
        let pods: Vec<String> = status
            .reserved_for
            .unwrap_or_default()
            .into_iter()
            .filter(|c| c.resource == "pods")
            .map(|c| c.uid)
            .collect();
        let prepared = PreparedClaim {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            pods,
            devices,
        };
        let generation = {
            let mut s = self.lock();
            let others = allocated_devices(s.claims.values());
            prepare_check(
                &prepared.devices,
                PrepareInput {
                    node: &self.node,
                    figures: s.figures.as_ref(),
                    claimless_keys: &s.claimless,
                    others: &others,
                },
            )?;
            // Taken now, so the prepares that run while this one is written see the devices held.
            s.claims.insert(claim.uid.clone(), prepared.clone());
            s.generation += 1;
            let generation = s.generation;
            s.unsaved.insert(claim.uid.clone(), generation);
            generation
        };
        let uid = claim.uid.clone();
        let undo = move |s: &mut State| {
            s.claims.remove(&uid);
            s.unsaved.remove(&uid);
        };
        self.persist(generation, undo)
            .await
            .map_err(|e| e.to_string())?;
        self.publish_claims(&self.lock());
        self.changed.notify_one();
        tracing::info!(claim = %what, devices = ?prepared.devices.iter().map(|d| &d.device).collect::<Vec<_>>(), pods = ?prepared.pods, "prepared");
        Ok((Self::devices_of(&prepared), "prepared"))
    }
}

impl DraHandler for Shared {
    async fn prepare(&self, request: NodePrepareResourcesRequest) -> NodePrepareResourcesResponse {
        let started = Instant::now();
        let mut out = NodePrepareResourcesResponse::default();
        for claim in &request.claims {
            let answer = match self.prepare_one(claim).await {
                Ok((devices, result)) => {
                    self.metrics.dra_prepared(result);
                    NodePrepareResourceResponse {
                        devices,
                        error: String::new(),
                    }
                }
                Err(error) => {
                    self.metrics.dra_prepared("refused");
                    tracing::warn!(claim = %format!("{}/{}", claim.namespace, claim.name), %error, "cannot prepare the claim; the kubelet retries");
                    NodePrepareResourceResponse {
                        devices: Vec::new(),
                        error,
                    }
                }
            };
            out.claims.insert(claim.uid.clone(), answer);
        }
        self.metrics
            .dra_prepare_seconds
            .observe(started.elapsed().as_secs_f64());
        out
    }

    async fn unprepare(
        &self,
        request: NodeUnprepareResourcesRequest,
    ) -> NodeUnprepareResourcesResponse {
        let uids: Vec<String> = request.claims.iter().map(|c| c.uid.clone()).collect();
        let (removed, saved) = self.forget(&uids).await;
        if let Err(e) = &saved {
            tracing::warn!(error = %e, "cannot record unprepared claims; the kubelet retries");
        }
        let mut out = NodeUnprepareResourcesResponse::default();
        for claim in &request.claims {
            let error = match &saved {
                Err(e) if removed.iter().any(|(u, _)| *u == claim.uid) => e.to_string(),
                _ => String::new(),
            };
            out.claims
                .insert(claim.uid.clone(), NodeUnprepareResourceResponse { error });
        }
        if saved.is_ok() && !removed.is_empty() {
            tracing::info!(claims = ?removed.iter().map(|(_, p)| format!("{}/{}", p.namespace, p.name)).collect::<Vec<_>>(), "unprepared");
            self.changed.notify_one();
        }
        out
    }
}
