//! The mechanism choice.

use super::*;

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
