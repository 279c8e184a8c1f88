//! The `teeguard-certs` binary end to end.

use std::path::Path;
use std::process::{Command, Output};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;

use teeguard_certs::{CertificateAuthority, ServingCertRequest};

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_teeguard-certs"))
        .args(args)
        // Keep the caller's environment from leaking into the flags.
        .env_remove("TEEGUARD_CERTS_SERVICE")
        .env_remove("TEEGUARD_CERTS_NAMESPACE")
        .env_remove("TEEGUARD_CERTS_OUT_DIR")
        .env_remove("TEEGUARD_CERTS_FORCE")
        .output()
        .expect("run teeguard-certs")
}

fn stdout(out: &Output) -> String {
    String::from_utf8(out.stdout.clone()).expect("utf8 stdout")
}

fn stderr(out: &Output) -> String {
    String::from_utf8(out.stderr.clone()).expect("utf8 stderr")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn ca_bundle_line(out: &str) -> &str {
    out.lines()
        .find_map(|l| l.strip_prefix("caBundle: "))
        .unwrap_or_else(|| panic!("no caBundle line in:\n{out}"))
}

#[test]
fn writes_files_prints_paths_and_ca_bundle_then_refuses_to_overwrite() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("certs");
    let dir_s = dir.to_str().expect("utf8 path");
    let args = [
        "--service",
        "teeguard-webhook",
        "--namespace",
        "teeguard",
        "--out-dir",
        dir_s,
        "--dns",
        "localhost",
        "--ip",
        "127.0.0.1",
    ];

    let first = run(&args);
    assert!(first.status.success(), "stderr: {}", stderr(&first));
    let out = stdout(&first);
    for file in ["ca.crt", "tls.crt", "tls.key"] {
        let path = dir.join(file);
        assert!(path.is_file(), "{file} written");
        assert!(
            out.contains(&format!("wrote {}", path.display())),
            "{file} path printed:\n{out}"
        );
    }
    assert!(!dir.join("ca.key").exists(), "no CA key unless asked");
    assert!(out.contains("DNS:teeguard-webhook.teeguard.svc"), "{out}");
    assert!(out.contains("IP:127.0.0.1"), "{out}");
    let ca_crt = read(&dir.join("ca.crt"));
    let decoded = STANDARD
        .decode(ca_bundle_line(&out))
        .expect("caBundle is base64");
    assert_eq!(
        decoded,
        ca_crt.as_bytes(),
        "caBundle decodes to exactly ca.crt"
    );
    assert!(read(&dir.join("tls.key")).starts_with("-----BEGIN PRIVATE KEY-----"));

    let tls_crt = read(&dir.join("tls.crt"));
    let second = run(&args);
    assert!(!second.status.success(), "second run must fail");
    assert_eq!(second.status.code(), Some(1));
    let err = stderr(&second);
    assert!(err.contains("refusing to overwrite"), "{err}");
    assert!(err.contains("ca.crt"), "names the file: {err}");
    assert!(err.contains("--force"), "says what to do: {err}");
    assert!(
        !err.contains("Error {") && !err.contains("Io {"),
        "no Debug output: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(stdout(&second).is_empty());
    assert_eq!(read(&dir.join("tls.crt")), tls_crt, "files untouched");

    let mut forced = args.to_vec();
    forced.push("--force");
    let third = run(&forced);
    assert!(third.status.success(), "stderr: {}", stderr(&third));
    assert_ne!(read(&dir.join("tls.crt")), tls_crt, "replaced with --force");
    assert_ne!(read(&dir.join("ca.crt")), ca_crt, "new CA with --force");
}

#[test]
fn reissues_under_an_existing_ca_and_writes_ca_key_on_request() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let first_dir = tmp.path().join("first");
    let first = run(&[
        "--service",
        "svc",
        "--namespace",
        "ns",
        "--out-dir",
        first_dir.to_str().expect("utf8"),
        "--write-ca-key",
    ]);
    assert!(first.status.success(), "stderr: {}", stderr(&first));
    let ca_key = first_dir.join("ca.key");
    assert!(stdout(&first).contains(&format!("wrote {}", ca_key.display())));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        for f in ["tls.key", "ca.key"] {
            let mode = std::fs::metadata(first_dir.join(f))
                .expect("meta")
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600, "{f}");
        }
    }

    let second_dir = tmp.path().join("second");
    let second = run(&[
        "--service",
        "svc",
        "--namespace",
        "ns",
        "--out-dir",
        second_dir.to_str().expect("utf8"),
        "--ca-cert",
        first_dir.join("ca.crt").to_str().expect("utf8"),
        "--ca-key",
        ca_key.to_str().expect("utf8"),
    ]);
    assert!(second.status.success(), "stderr: {}", stderr(&second));
    assert_eq!(
        read(&second_dir.join("ca.crt")),
        read(&first_dir.join("ca.crt")),
        "same CA"
    );
    assert_ne!(
        read(&second_dir.join("tls.crt")),
        read(&first_dir.join("tls.crt"))
    );
    // The CA still issues: the key on disk is the CA's.
    let ca = CertificateAuthority::from_pem_files(&first_dir.join("ca.crt"), &ca_key)
        .expect("written CA loads");
    ca.issue(&ServingCertRequest::for_service("svc", "ns"))
        .expect("issue");
}

#[test]
fn bad_input_gives_clear_errors_and_nonzero_exit() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let out_dir = tmp.path().join("out");
    let out_s = out_dir.to_str().expect("utf8");
    let missing = tmp.path().join("missing.crt");
    let missing_s = missing.to_str().expect("utf8");

    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec![
                "--service",
                "Bad_Name",
                "--namespace",
                "ns",
                "--out-dir",
                out_s,
            ],
            "invalid service \"Bad_Name\"",
        ),
        (
            vec![
                "--service",
                "svc",
                "--namespace",
                "ns",
                "--out-dir",
                out_s,
                "--dns",
                "10.0.0.1",
            ],
            "--ip",
        ),
        (vec!["--out-dir", out_s], "names nothing"),
        (
            vec![
                "--service",
                "svc",
                "--namespace",
                "ns",
                "--out-dir",
                out_s,
                "--validity-days",
                "0",
            ],
            "out of range",
        ),
        (
            vec![
                "--service",
                "svc",
                "--namespace",
                "ns",
                "--out-dir",
                out_s,
                "--ca-cert",
                missing_s,
                "--ca-key",
                missing_s,
            ],
            "could not read CA certificate",
        ),
    ];
    for (args, want) in cases {
        let out = run(&args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.starts_with("teeguard-certs: error: "), "{err}");
        assert!(err.contains(want), "{args:?}: want {want:?} in {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    assert!(!out_dir.exists(), "nothing written on bad input");

    // Usage errors come from clap (exit code 2).
    for args in [
        vec!["--service", "svc", "--out-dir", out_s],
        vec![
            "--service",
            "svc",
            "--namespace",
            "ns",
            "--out-dir",
            out_s,
            "--ca-cert",
            missing_s,
        ],
        vec![
            "--service",
            "svc",
            "--namespace",
            "ns",
            "--out-dir",
            out_s,
            "--ip",
            "not-an-ip",
        ],
    ] {
        let out = run(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
    }
}

#[test]
fn environment_variables_configure_the_run() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("env");
    let out = Command::new(env!("CARGO_BIN_EXE_teeguard-certs"))
        .env("TEEGUARD_CERTS_SERVICE", "envsvc")
        .env("TEEGUARD_CERTS_NAMESPACE", "envns")
        .env("TEEGUARD_CERTS_OUT_DIR", &dir)
        .env("TEEGUARD_CERTS_DNS", "a.example,b.example")
        .output()
        .expect("run");
    assert!(out.status.success(), "stderr: {}", stderr(&out));
    let text = stdout(&out);
    for san in ["DNS:envsvc.envns.svc", "DNS:a.example", "DNS:b.example"] {
        assert!(text.contains(san), "{san} in {text}");
    }
    assert!(dir.join("tls.crt").is_file());
}
