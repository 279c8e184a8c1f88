//! `teeguard-agent run` as a process: kubeconfig to the fake API server over TCP, the simulated host,
//! the admin port (`/livez`, `/readyz`, `/metrics`) and SIGTERM.

mod common;

use std::process::{Child, Command, Stdio};

use common::{NODE, WAIT, node_capacity, tdx_vm};
use teeguard_shared::TeeCapacity;
use teeguard_tests::fakeapi::FakeApiServer;
use teeguard_tests::fixtures::{TDX_KEYS, tdx_node};
use teeguard_tests::host::{SimHost, TDX};
use teeguard_tests::ports::free_ports;
use teeguard_tests::wait::{PATIENCE, until};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BIN: &str = env!("CARGO_BIN_EXE_teeguard-agent");

async fn http_get(addr: &str, path: &str) -> Option<String> {
    let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .ok()?;
    let mut out = String::new();
    stream.read_to_string(&mut out).await.ok()?;
    Some(out)
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        // Only if the test failed before the orderly stop.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_serves_admin_endpoints_publishes_and_stops_on_sigterm() {
    let api = FakeApiServer::new();
    let served = api.serve().await.expect("serve");
    api.create(&tdx_node(NODE, 16, false)).expect("node");
    let host = SimHost::builder().capacity(TDX, 16).build().expect("host");
    for i in 0..4 {
        tdx_vm(&api, &host, &format!("vm{i}"), true);
    }
    host.add_external("outside", TDX, 2).expect("external");

    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = dir.path().join("kubeconfig");
    served.write_kubeconfig(&kubeconfig).expect("kubeconfig");
    let config = dir.path().join("teeguard.yaml");
    std::fs::write(&config, "agent:\n  pollInterval: 100ms\n").expect("config");
    let [admin_port] = free_ports().expect("a free port");
    let admin = format!("127.0.0.1:{admin_port}");
    let log = dir.path().join("agent.log");
    let child = Command::new(BIN)
        .args([
            "run",
            "--cgroup-root",
            &host.root().display().to_string(),
            "--config",
            &config.display().to_string(),
            "--admin-addr",
            &admin,
            "--log-format",
            "json",
        ])
        .env("NODE_NAME", NODE)
        .env("KUBECONFIG", &kubeconfig)
        .env("RUST_LOG", "info")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("TEEGUARD_CONFIG")
        .env_remove("TEEGUARD_CGROUP_ROOT")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("spawn teeguard-agent run");
    let mut child = Killed(child);
    let logs = || std::fs::read_to_string(&log).unwrap_or_default();

    // Ready once scanned and the pod cache is synced.
    until("/readyz to answer 200", PATIENCE, async || {
        let ready = http_get(&admin, "/readyz")
            .await
            .is_some_and(|r| r.starts_with("HTTP/1.1 200"));
        assert!(
            ready || child.0.try_wait().expect("try_wait").is_none(),
            "agent exited early:\n{}",
            logs()
        );
        ready
    })
    .await
    .unwrap_or_else(|e| panic!("{e}:\n{}", logs()));
    let livez = http_get(&admin, "/livez").await.expect("livez");
    assert!(livez.starts_with("HTTP/1.1 200"), "{livez}");

    let status = api
        .wait_for(WAIT, "published report", |api| {
            api.get_typed::<TeeCapacity>(None, NODE)
                .ok()
                .flatten()
                .and_then(|t| t.status)
                .filter(|s| s.tdx.as_ref().is_some_and(|t| t.pods_used == 4))
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", logs()));
    let t = status.tdx.expect("tdx");
    assert_eq!((t.external, t.free, t.advertised), (2, 10, Some(14)));
    api.wait_for(WAIT, "advertised", |api| {
        api.get_typed::<k8s_openapi::api::core::v1::Node>(None, NODE)
            .ok()
            .flatten()
            .filter(|n| node_capacity(n, TDX_KEYS).as_deref() == Some("14"))
    })
    .await
    .expect("advertised");

    let metrics = http_get(&admin, "/metrics").await.expect("metrics");
    for line in [
        "teeguard_agent_free_keys{kind=\"tdx\"} 10",
        "teeguard_agent_external_keys{kind=\"tdx\"} 2",
        "teeguard_agent_pods_used_keys{kind=\"tdx\"} 4",
        "teeguard_agent_capacity_keys{kind=\"tdx\"} 16",
        "teeguard_agent_publishes_total",
        "teeguard_agent_scan_duration_seconds_bucket",
    ] {
        assert!(metrics.contains(line), "missing {line:?} in\n{metrics}");
    }

    // SIGTERM: a clean, prompt exit (within WAIT).
    let pid = child.0.id().to_string();
    let killed = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(killed.success());
    let exit = until("an exit after SIGTERM", WAIT, async || {
        child.0.try_wait().expect("try_wait")
    })
    .await
    .unwrap_or_else(|e| panic!("{e}:\n{}", logs()));
    assert!(exit.success(), "{exit:?}\n{}", logs());
    let logs = logs();
    assert!(logs.contains("shutdown requested"), "{logs}");
    assert!(
        logs.lines().all(|l| l.trim_start().starts_with('{')),
        "JSON logs only:\n{logs}"
    );
}
