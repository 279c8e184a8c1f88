//! Free TCP ports on 127.0.0.1, for what a test starts with a port on its command line (the control
//! plane's components, a kubelet, the webhook and agent processes).

use std::net::TcpListener;

/// `N` distinct ports that are free on 127.0.0.1: bound together, so that none is handed out twice,
/// then released for the caller to pass on. Another process may take one in between; that is rare,
/// and the component that cannot bind says so.
pub fn free_ports<const N: usize>() -> std::io::Result<[u16; N]> {
    let listeners = (0..N)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<Vec<_>>>()?;
    let mut ports = [0; N];
    for (port, listener) in ports.iter_mut().zip(&listeners) {
        *port = listener.local_addr()?.port();
    }
    Ok(ports)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ports_are_distinct_and_free() {
        let ports: [u16; 4] = free_ports().expect("free ports");
        let distinct: std::collections::BTreeSet<_> = ports.iter().collect();
        assert_eq!(distinct.len(), 4, "{ports:?}");
        for port in ports {
            TcpListener::bind(("127.0.0.1", port)).expect("free again once released");
        }
    }
}
