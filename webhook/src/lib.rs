//! teeguard's admission webhook, in layers; each imports only the ones below it (checked by
//! `tests/structure.rs`):
//!
//! - [`web`]: the HTTPS server, TLS and certificate reload, the stall guard, the AdmissionReview
//!   envelope, the handlers that turn a request into a decision and a response (`POST /mutate`,
//!   `POST /validate`), and the forward of a review to the deciding replica.
//! - [`cluster`]: what talks to the API server: reflector caches of VMIs, Namespaces, TeeCapacities,
//!   Nodes, `TeeReservation`s, the agents' Leases and virt-launcher pods with one GET on a miss; the
//!   admission index behind its lock; the holds and their write-behind; the decider's Lease; the retry
//!   planner; Events.
//! - [`metrics`]: the Prometheus series; maps the decisions' outcomes to labels.
//! - [`decide`]: the pure decisions: mutation (which pods get a TEE key request and limit
//!   annotations, and the JSON Patch), validation (free keys on a node or any candidate node, stale
//!   reports, enforce/warn, forged limit annotations), node selection, and the life of a key (holds,
//!   the index, the queue, the decider's election). No runtime, client, server or metrics: tested
//!   without any.
//! - [`pods`]: the decoded pod types the decisions and the pod cache share; [`error`]: the error enum.
//!
//! On top: [`app`] wires `serve`, [`review`] is the offline `review` command on the same decision
//! calls, [`cli`] parses the command line, and [`run`] dispatches it.

pub mod app;
pub mod cli;
pub mod cluster;
pub mod decide;
pub mod error;
pub mod metrics;
pub mod pods;
pub mod review;
pub mod web;

pub use error::{Error, Result};

/// Run one parsed command line: `serve` on a multi-threaded runtime, `review` on a single thread.
pub fn run(cli: cli::Cli) -> Result<()> {
    teeguard_shared::ops::init_tracing(cli.log_format);
    match cli.command {
        cli::Command::Serve(args) => {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .map_err(Error::Runtime)?;
            rt.block_on(app::run(args))
        }
        cli::Command::Review(args) => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(Error::Runtime)?;
            let stdout = std::io::stdout();
            rt.block_on(review::run(&args, &mut stdout.lock()))
        }
    }
}
