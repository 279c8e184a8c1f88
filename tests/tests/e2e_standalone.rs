//! The standalone binary (`teeguard-standalone`, the README's first command) run as a user runs it:
//! its table must show the scenario's key decisions, fit 100 columns, and its `curl` hint must work
//! while it keeps serving.

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use teeguard_tests::standalone::WebhookClient;

const BIN: &str = env!("CARGO_BIN_EXE_teeguard-standalone");
const DEADLINE: Duration = Duration::from_secs(120);

/// A child whose stdout is collected by a thread; killed when dropped.
struct Running {
    child: Child,
    out: Arc<Mutex<String>>,
    err: Arc<Mutex<String>>,
}

impl Running {
    fn start(args: &[&str]) -> Running {
        let mut child = Command::new(BIN)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start teeguard-standalone");
        let collect = |mut r: Box<dyn Read + Send>| {
            let buf = Arc::new(Mutex::new(String::new()));
            let b = buf.clone();
            std::thread::spawn(move || {
                let mut chunk = [0u8; 4096];
                while let Ok(n) = r.read(&mut chunk) {
                    if n == 0 {
                        break;
                    }
                    b.lock()
                        .expect("output lock")
                        .push_str(&String::from_utf8_lossy(&chunk[..n]));
                }
            });
            buf
        };
        let out = collect(Box::new(child.stdout.take().expect("stdout")));
        let err = collect(Box::new(child.stderr.take().expect("stderr")));
        Running { child, out, err }
    }

    fn stdout(&self) -> String {
        self.out.lock().expect("output lock").clone()
    }

    fn stderr(&self) -> String {
        self.err.lock().expect("output lock").clone()
    }

    /// Wait for the process to exit; returns whether it succeeded.
    fn wait(&mut self) -> bool {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                // Let the reader threads drain the pipes.
                std::thread::sleep(Duration::from_millis(100));
                return status.success();
            }
            assert!(
                start.elapsed() < DEADLINE,
                "teeguard-standalone did not exit within {DEADLINE:?}; stdout:\n{}\nstderr:\n{}",
                self.stdout(),
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Wait until stdout contains `needle`.
    fn wait_for(&mut self, needle: &str) -> String {
        let start = Instant::now();
        loop {
            let out = self.stdout();
            if out.contains(needle) {
                return out;
            }
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                panic!(
                    "teeguard-standalone exited ({status}) before printing {needle:?}; stdout:\n{out}\nstderr:\n{}",
                    self.stderr()
                );
            }
            assert!(
                start.elapsed() < DEADLINE,
                "no {needle:?} within {DEADLINE:?}; stdout:\n{out}\nstderr:\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The table's rows (after the rule, up to the blank line), each with its wrapped message lines
/// joined: a line whose first 50 columns are blank continues the row above.
fn table(out: &str) -> Vec<String> {
    let mut rows: Vec<String> = Vec::new();
    for line in out
        .lines()
        .skip_while(|l| !l.starts_with("---"))
        .skip(1)
        .take_while(|l| !l.is_empty())
    {
        let continues = line.chars().take(50).all(char::is_whitespace);
        match rows.last_mut() {
            Some(last) if continues => {
                last.push(' ');
                last.push_str(line.trim());
            }
            _ => rows.push(line.to_string()),
        }
    }
    rows
}

/// The first table row whose first cells are these words (spacing ignored; the step number is
/// optional unless `cells` starts with one).
fn row<'a>(rows: &'a [String], cells: &[&str]) -> Option<&'a str> {
    let want = cells.join(" ");
    let numeric = |w: &str| !w.is_empty() && w.chars().all(|c| c.is_ascii_digit());
    let with_step = cells.first().is_some_and(|c| numeric(c));
    rows.iter()
        .find(|l| {
            let mut words: Vec<&str> = l.split_whitespace().collect();
            if !with_step && words.first().is_some_and(|w| numeric(w)) {
                words.remove(0);
            }
            words.join(" ").starts_with(&want)
        })
        .map(String::as_str)
}

#[test]
fn scenario_table_shows_patches_denials_and_retries() {
    let mut sa = Running::start(&["--port", "0", "--no-wait"]);
    let ok = sa.wait();
    let out = sa.stdout();
    assert!(ok, "exit status; stdout:\n{out}\nstderr:\n{}", sa.stderr());
    let rows = table(&out);
    assert!(rows.len() > 20, "table:\n{out}");
    for line in out.lines().skip_while(|l| !l.starts_with('#')) {
        if line.starts_with("curl ") {
            break;
        }
        assert!(
            line.chars().count() <= 100,
            "line wider than 100 columns: {line:?}"
        );
    }
    let expect =
        |cells: &[&str]| row(&rows, cells).unwrap_or_else(|| panic!("no row {cells:?} in:\n{out}"));
    // Steps 1–6: the host fills up; every VM is patched, admitted and bound, free keys fall.
    assert!(expect(&["1", "legacy-db", "host", "started", "7"]).contains("external"));
    assert!(
        expect(&["2", "vm-1", "pod", "/mutate", "patched", "7"]).contains("tdx.intel.com/keys: 1")
    );
    expect(&["vm-1", "pod", "/validate", "admitted", "7"]);
    expect(&["vm-1", "binding", "/validate", "bound", "6"]);
    expect(&["kata-tdx", "pod", "/mutate", "skipped"]);
    expect(&["vm-4", "binding", "/validate", "bound", "2"]);
    expect(&["7", "nightly-batch", "host", "started", "0"]);
    // The host is full: vm-5 is refused at pod CREATE, with an Event on its VMI.
    assert!(
        expect(&["vm-5", "pod", "/validate", "denied", "0"])
            .contains("no node can host this TDX VM")
    );
    expect(&["vmi", "vm-5", "webhook", "event"]);
    // vm-2 stops: vm-5's retry is admitted and starts.
    expect(&["9", "vm-2", "KubeVirt", "stopped", "1"]);
    expect(&["vm-5", "pod", "/validate", "admitted", "1"]);
    expect(&["vm-5", "binding", "/validate", "bound", "0"]);
    // The binding race: a key taken outside Kubernetes between scheduling and binding.
    expect(&["vm-6", "pod", "scheduler", "chose", "1"]);
    assert!(
        expect(&["14", "vm-6", "binding", "/validate", "denied", "0"])
            .contains("node node-a cannot host this TDX VM")
    );
    expect(&["vmi", "vm-6", "webhook", "event"]);
    expect(&["16", "vm-6", "binding", "/validate", "bound", "0"]);
    // The summary.
    // Kernel enforcement: the agent's limit on vm-1's pod holds its second key back.
    assert!(
        out.contains("enforcement: vm-1's pod cgroup has misc.max \"tdx 1\"; a second key in it: refused by the kernel"),
        "{out}"
    );
    assert!(
        out.contains("keys in use never exceeded the capacity (peak 8 of 8); VMs that failed to start for lack of a key: 0"),
        "{out}"
    );
    assert!(
        out.contains("webhook: 7 pods patched, 1 pod CREATE and 1 binding refused"),
        "{out}"
    );
    let curl = out
        .lines()
        .find(|l| l.starts_with("curl "))
        .unwrap_or_else(|| panic!("no curl line in:\n{out}"));
    assert!(
        curl.contains("--cacert ")
            && curl.contains("-H 'Content-Type: application/json' --data @")
            && curl.contains("tests/fixtures/admission/mutate-tdx-pod.json https://127.0.0.1:")
            && curl.ends_with("/mutate"),
        "{curl}"
    );
}

#[test]
fn keeps_serving_the_curl_sample_until_interrupted() {
    let mut sa = Running::start(&["--port", "0"]);
    let out = sa.wait_for("Press Ctrl-C to stop.");
    let curl = out
        .lines()
        .find(|l| l.starts_with("curl "))
        .unwrap_or_else(|| panic!("no curl line in:\n{out}"))
        .to_string();
    // Do what the printed command does, with the same files.
    let words: Vec<&str> = curl.split_whitespace().collect();
    let ca = words[words
        .iter()
        .position(|w| *w == "--cacert")
        .expect("--cacert")
        + 1];
    let data = words
        .iter()
        .find_map(|w| w.strip_prefix('@'))
        .expect("--data @file");
    let url = words.last().expect("url");
    let addr: std::net::SocketAddr = url
        .strip_prefix("https://")
        .and_then(|u| u.strip_suffix("/mutate"))
        .expect("https://<addr>/mutate")
        .parse()
        .expect("address");
    let ca_pem = std::fs::read_to_string(ca).expect("CA file exists while serving");
    let review: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(data).expect("sample exists"))
            .expect("sample is JSON");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let reply = rt.block_on(async {
        let client = WebhookClient::from_ca_pem(addr, &ca_pem).expect("client");
        client.review("/mutate", &review).await.expect("review")
    });
    assert!(reply.allowed, "{:?}", reply.raw);
    let patch = serde_json::to_string(&reply.patch.expect("a JSON patch")).expect("json");
    assert!(patch.contains("tdx.intel.com~1keys"), "{patch}");

    // Ctrl-C stops it cleanly.
    let pid = sa.child.id().to_string();
    let status = Command::new("kill")
        .args(["-INT", &pid])
        .status()
        .expect("kill -INT");
    assert!(status.success());
    assert!(
        sa.wait(),
        "clean exit after Ctrl-C; stderr:\n{}",
        sa.stderr()
    );
    assert!(sa.stdout().contains("stopping..."), "{}", sa.stdout());
}

#[test]
fn a_taken_port_is_a_clear_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port().to_string();
    let mut sa = Running::start(&["--port", &port, "--no-wait"]);
    assert!(!sa.wait(), "must fail; stdout:\n{}", sa.stdout());
    let err = sa.stderr();
    assert!(
        err.contains(&format!("127.0.0.1:{port}"))
            && err.contains("in use")
            && err.contains("--port"),
        "{err}"
    );
}
