//! The images `scripts/images.sh` builds (OCI archives in the directory named by `TEEGUARD_IMAGES`;
//! `scripts/test.sh` builds them and sets it): each holds its binary, everything that binary needs to
//! start (it runs from the image's own root, `--version` answering the workspace version), the non-root
//! user the chart runs it as, the labels a registry shows, and stays small. Skipped (one line) without
//! `TEEGUARD_IMAGES`, unless `CI=true`.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use teeguard_tests::node::built_images;

/// The images and their binaries.
const IMAGES: [&str; 2] = ["teeguard-webhook", "teeguard-agent"];

/// An image archive larger than this is a regression (today about 9 MiB each).
const MAX_ARCHIVE_BYTES: u64 = 24 * 1024 * 1024;

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn json(path: &Path) -> Value {
    let text = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn blob(dir: &Path, digest: &str) -> PathBuf {
    let (algo, hex) = digest.split_once(':').expect("algo:hex digest");
    dir.join("blobs").join(algo).join(hex)
}

/// An unpacked image: its config and its root filesystem.
struct Unpacked {
    config: Value,
    root: PathBuf,
    _dir: tempfile::TempDir,
}

fn unpack(archive: &Path) -> Unpacked {
    let dir = tempfile::tempdir().expect("temp dir");
    let layout = dir.path().join("layout");
    let root = dir.path().join("root");
    std::fs::create_dir_all(&layout).expect("layout dir");
    std::fs::create_dir_all(&root).expect("root dir");
    run(Command::new("tar")
        .arg("-xf")
        .arg(archive)
        .arg("-C")
        .arg(&layout));
    let index = json(&layout.join("index.json"));
    let manifests = index["manifests"].as_array().expect("index.manifests");
    assert_eq!(manifests.len(), 1, "one image per archive: {index}");
    let manifest = json(&blob(
        &layout,
        manifests[0]["digest"].as_str().expect("digest"),
    ));
    let config = json(&blob(
        &layout,
        manifest["config"]["digest"]
            .as_str()
            .expect("config digest"),
    ));
    for layer in manifest["layers"].as_array().expect("layers") {
        let path = blob(&layout, layer["digest"].as_str().expect("layer digest"));
        let gzip = layer["mediaType"]
            .as_str()
            .is_some_and(|m| m.ends_with("+gzip"));
        let mut tar = Command::new("tar");
        tar.arg(if gzip { "-xzf" } else { "-xf" })
            .arg(&path)
            .arg("-C")
            .arg(&root);
        run(&mut tar);
    }
    Unpacked {
        config,
        root,
        _dir: dir,
    }
}

#[test]
fn each_image_runs_its_binary_from_its_own_root_as_the_charts_non_root_user_and_stays_small() {
    let Some(dir) = built_images() else {
        return;
    };
    let version = env!("CARGO_PKG_VERSION");
    for name in IMAGES {
        let archive = dir.join(format!("{name}.tar"));
        let size = std::fs::metadata(&archive)
            .unwrap_or_else(|e| panic!("{}: {e}; run scripts/images.sh", archive.display()))
            .len();
        assert!(
            size <= MAX_ARCHIVE_BYTES,
            "{name}: {size} bytes, over {MAX_ARCHIVE_BYTES}: what was added to the image?"
        );
        let image = unpack(&archive);
        let c = &image.config["config"];
        assert_eq!(c["User"], "65532:65532", "{name}: {c}");
        assert_eq!(
            c["Entrypoint"],
            serde_json::json!([format!("/usr/local/bin/{name}")]),
            "{name}: {c}"
        );
        let labels = &c["Labels"];
        assert_eq!(labels["org.opencontainers.image.title"], name);
        assert_eq!(labels["org.opencontainers.image.version"], version);
        assert_eq!(
            labels["org.opencontainers.image.source"],
            "https://github.com/teeguard/teeguard"
        );
        let revision = labels["org.opencontainers.image.revision"]
            .as_str()
            .unwrap_or("");
        assert!(
            revision.len() == 40 && revision.chars().all(|c| c.is_ascii_hexdigit()),
            "{name}: revision label {revision:?} is not a commit"
        );
        let passwd = std::fs::read_to_string(image.root.join("etc/passwd")).expect("passwd");
        assert!(passwd.contains(":65532:65532:"), "{passwd}");
        let tmp = std::fs::metadata(image.root.join("tmp")).expect("/tmp");
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&tmp.permissions()) & 0o7777,
            0o1777
        );
        // Nothing but the binary, its libraries and /etc: no shell, no package manager.
        assert!(!image.root.join("bin/sh").exists(), "{name} has a shell");

        // The binary starts from the image's root alone: every library it links is there.
        if !is_root() {
            eprintln!("{name}: not root, so the chroot run is skipped");
            continue;
        }
        let out = run(Command::new("chroot")
            .arg(&image.root)
            .arg(format!("/usr/local/bin/{name}"))
            .arg("--version"));
        assert_eq!(out.trim(), format!("{name} {version}"));
    }
}

fn is_root() -> bool {
    run(Command::new("id").arg("-u")).trim() == "0"
}
