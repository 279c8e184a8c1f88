//! The mechanism choice and the `Enforcing` condition.

use super::*;

fn host(kinds: &[TeeKind], delegated: bool) -> HostFacts {
    HostFacts {
        kinds: kinds.to_vec(),
        delegated,
        delegation_reason: if delegated {
            "pod cgroups under /sys/fs/cgroup/kubepods.slice carry misc.current".into()
        } else {
            "kubepods.slice/cgroup.subtree_control does not enable the misc controller".into()
        },
        kubepods: Some("/sys/fs/cgroup/kubepods.slice".into()),
        driver: Some(Driver::Systemd),
    }
}

#[test]
fn auto_takes_nri_only_when_the_socket_exists() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("nri.sock");
    assert_eq!(choose(EnforcementMode::Auto, &socket), Mechanism::Cgroup);
    std::fs::write(&socket, "").expect("socket stand-in");
    assert_eq!(choose(EnforcementMode::Auto, &socket), Mechanism::Nri);
    assert_eq!(choose(EnforcementMode::Cgroup, &socket), Mechanism::Cgroup);
    assert_eq!(
        choose(EnforcementMode::Nri, &dir.path().join("x")),
        Mechanism::Nri
    );
    assert_eq!(choose(EnforcementMode::Off, &socket), Mechanism::Off);
}

fn cond(
    mechanism: Mechanism,
    host: Option<&HostFacts>,
    nri: Option<&NriState>,
    writer: Option<&WriterStatus>,
) -> ConditionSpec {
    condition(&EnforcingInput {
        mechanism,
        strict: false,
        host,
        nri,
        writer,
    })
}

#[test]
fn enforcing_says_which_mechanism_and_why_not() {
    let ok = host(&[TeeKind::Tdx], true);
    let registered = NriState::Registered {
        runtime: "containerd 2.1.0".into(),
    };
    let c = cond(Mechanism::Nri, Some(&ok), Some(&registered), None);
    assert_eq!((c.status, c.reason), ("True", reasons::NRI));
    assert!(
        c.message.starts_with("mechanism nri; strict off;"),
        "{}",
        c.message
    );
    assert!(c.message.contains("containerd 2.1.0"));

    let down = NriState::Disconnected {
        reason: "cannot connect to /var/run/nri/nri.sock: connection refused".into(),
    };
    let c = cond(Mechanism::Nri, Some(&ok), Some(&down), None);
    assert_eq!((c.status, c.reason), ("False", reasons::NRI_UNAVAILABLE));
    assert!(c.message.contains("connection refused"));

    let c = cond(
        Mechanism::Cgroup,
        Some(&ok),
        None,
        Some(&WriterStatus {
            applied: 2,
            waiting: 1,
            ..Default::default()
        }),
    );
    assert_eq!((c.status, c.reason), ("True", reasons::CGROUP));
    assert!(
        c.message.contains("2 pods limited, 1 waiting"),
        "{}",
        c.message
    );

    let c = cond(
        Mechanism::Cgroup,
        Some(&host(&[TeeKind::Tdx], false)),
        None,
        None,
    );
    assert_eq!((c.status, c.reason), ("False", reasons::NOT_DELEGATED));
    assert!(c.message.contains("subtree_control"), "{}", c.message);

    let c = cond(
        Mechanism::Nri,
        Some(&host(&[], true)),
        Some(&registered),
        None,
    );
    assert_eq!((c.status, c.reason), ("False", reasons::NO_TEE_HARDWARE));

    let c = cond(Mechanism::Off, Some(&ok), None, None);
    assert_eq!(
        (c.status, c.reason, c.type_),
        ("False", reasons::OFF, "Enforcing")
    );

    let c = cond(Mechanism::Cgroup, None, None, None);
    assert_eq!(c.reason, reasons::NOT_SCANNED);

    let not_delegated = WriterStatus {
        not_delegated: Some("pod cgroup /x has no misc.max".into()),
        ..Default::default()
    };
    let c = cond(Mechanism::Cgroup, Some(&ok), None, Some(&not_delegated));
    assert_eq!((c.status, c.reason), ("False", reasons::NOT_DELEGATED));
}
