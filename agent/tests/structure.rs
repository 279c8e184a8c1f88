//! The shape of `agent/src`, checked so that it lasts: layers that import only downwards, a pure core,
//! one module per thing the agent talks to (none importing another), no import circles, short files
//! that say what they hold (the checker: `teeguard_tests::structure`, shared with the webhook).
//!
//! Layers, bottom to top (a module may import the layers below it, and its own layer where noted):
//!
//! | rank | modules | what |
//! |---|---|---|
//! | 0 | `error` | the crate's error enum |
//! | 1 | `decide` | the pure core: scan results, cgroup names, reuse of readings, attribution, the report and its conditions, the advertise plan, the limits, the `Enforcing` condition |
//! | 2 | `metrics` | Prometheus series |
//! | 3 | `kernel`, `cluster`, `runtime`, `kubelet` | what the agent talks to: the host's cgroup files, the API server, the container runtime (NRI), the kubelet's plugin sockets (DRA); apart: none imports another |
//! | 4 | `enforce`, `dra` | kernel enforcement, and the DRA driver, wired from the layer below |
//! | 5 | `run` | the agent's loop: scan, reconcile, publish |
//! | 6 | `cli`, `scan`, `lib`, `main` | the command line (`run`, `scan`, `cleanup`); `scan` prints one scan |
//!
//! `decide/` may import nothing of the crate but itself and `error`, and no runtime, client, file,
//! watch or metrics crate.

use teeguard_tests::structure::{Layer, Layers, assert_layered};

const fn layer(modules: &'static [&'static str]) -> Layer {
    Layer {
        modules,
        siblings_share: true,
    }
}

const AGENT: Layers = Layers {
    name: "agent/src",
    crate_name: "teeguard_agent",
    layers: &[
        layer(&["error"]),
        layer(&["decide"]),
        layer(&["metrics"]),
        Layer {
            modules: &["kernel", "cluster", "runtime", "kubelet"],
            siblings_share: false,
        },
        Layer {
            modules: &["enforce", "dra"],
            siblings_share: false,
        },
        layer(&["run"]),
        layer(&["cli", "scan", "lib", "main"]),
    ],
    core: "decide",
    core_may_import: &["error"],
    impure: &[
        "tokio",
        "tokio_util",
        "futures",
        "kube",
        "notify",
        "prometheus_client",
        "axum",
        "hyper_util",
        "std::fs",
        "std::net",
    ],
};

#[test]
fn agent_modules_import_only_downwards_and_the_core_is_pure() {
    assert_layered(env!("CARGO_MANIFEST_DIR"), &AGENT);
}
