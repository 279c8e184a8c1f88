//! The shape of `webhook/src`, checked so that it lasts: layers that import only downwards, a pure
//! decision core, no import circles, short files that say what they hold (the checker:
//! `teeguard_tests::structure`).
//!
//! Layers, bottom to top (a module may import its own layer and the layers below it):
//!
//! | rank | modules | what |
//! |---|---|---|
//! | 0 | `error` | the crate's error enum |
//! | 1 | `pods` | decoded pod types (what the decisions take as input) |
//! | 2 | `decide` | mutation, validation, node selection, the admission index and its holds: pure |
//! | 3 | `metrics` | Prometheus series; maps the decisions' outcomes to labels |
//! | 4 | `cluster` | what talks to the API server: caches (watches, lookups, cache-miss GETs), the index behind its lock, hold writes, the retry planner, Events |
//! | 5 | `web` | server, TLS, stall guard, the AdmissionReview envelope, handlers |
//! | 6 | `app`, `cli`, `review`, `lib`, `main` | wiring, command line, the offline `review` |
//!
//! `decide/` may import nothing of the crate but itself and `pods`, and no runtime, client, server
//! or metrics crate.

use teeguard_tests::structure::{Layer, Layers, assert_layered};

const fn layer(modules: &'static [&'static str]) -> Layer {
    Layer {
        modules,
        siblings_share: true,
    }
}

const WEBHOOK: Layers = Layers {
    name: "webhook/src",
    crate_name: "teeguard_webhook",
    layers: &[
        layer(&["error"]),
        layer(&["pods"]),
        layer(&["decide"]),
        layer(&["metrics"]),
        layer(&["cluster"]),
        layer(&["web"]),
        layer(&["app", "cli", "review", "lib", "main"]),
    ],
    core: "decide",
    core_may_import: &["pods"],
    impure: &[
        "tokio",
        "kube",
        "axum",
        "hyper",
        "prometheus_client",
        "tower",
    ],
};

#[test]
fn webhook_modules_import_only_downwards_and_the_decision_core_is_pure() {
    assert_layered(env!("CARGO_MANIFEST_DIR"), &WEBHOOK);
}
