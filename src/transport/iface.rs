//! Which network interface a rank listens on, chosen as NCCL chooses with
//! `NCCL_SOCKET_IFNAME` (ours is `OXCCL_SOCKET_IFNAME`).
//!
//! # Spec syntax
//!
//! A comma-separated list of name prefixes (`eth`, `eth0,ib`). A leading `^`
//! excludes the listed interfaces instead (`^docker,lo`); a leading `=`
//! (after the `^` when both are given) matches whole names instead of
//! prefixes (`=eth0`, `^=docker0`). An empty spec counts as none.
//!
//! # Selection
//!
//! With a spec: the first up interface that matches, in the order the OS
//! lists them, IPv4 addresses before IPv6 ones. Without: the up interface
//! whose subnet holds the master's address (longest prefix first; a loopback
//! master picks loopback), else the first up interface that is neither
//! loopback nor a virtual bridge (`docker*`, `virbr*`, `veth*`), else a
//! virtual bridge, else loopback — IPv4 first at each step.

use std::ffi::CStr;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::error::{Error, Result};

/// One address of one network interface.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Interface {
    pub name: String,
    pub addr: IpAddr,
    pub prefix_len: u8,
    pub up: bool,
    pub loopback: bool,
}

impl Interface {
    /// Whether `ip` is in this interface's subnet (never for a /0).
    fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(a), IpAddr::V4(b)) if self.prefix_len > 0 => {
                let shift = 32 - u32::from(self.prefix_len.min(32));
                let mask = u32::MAX.checked_shl(shift).unwrap_or(0);
                u32::from(a) & mask == u32::from(b) & mask
            }
            (IpAddr::V6(a), IpAddr::V6(b)) if self.prefix_len > 0 => {
                let shift = 128 - u32::from(self.prefix_len.min(128));
                let mask = u128::MAX.checked_shl(shift).unwrap_or(0);
                u128::from(a) & mask == u128::from(b) & mask
            }
            _ => false,
        }
    }

    fn is_virtual_bridge(&self) -> bool {
        ["docker", "virbr", "veth"]
            .iter()
            .any(|p| self.name.starts_with(p))
    }
}

/// Every IPv4 and IPv6 address of every interface, in the order the OS lists
/// them (IPv6 link-local addresses, `fe80::/10`, are left out: they need a
/// scope id to be reached).
pub(crate) fn list_interfaces() -> io::Result<Vec<Interface>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(io::Error::last_os_error());
    }
    /// Frees the list on every path out of this function.
    struct List(*mut libc::ifaddrs);
    impl Drop for List {
        fn drop(&mut self) {
            if !self.0.is_null() {
                // SAFETY: the pointer came from getifaddrs and is freed once.
                unsafe { libc::freeifaddrs(self.0) };
            }
        }
    }
    let list = List(head);
    let mut out = Vec::new();
    let mut cursor = list.0;
    while !cursor.is_null() {
        // SAFETY: a node of the list getifaddrs returned, alive until `list`
        // drops.
        let ifa = unsafe { &*cursor };
        cursor = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: a non-null address; the family says which sockaddr it is.
        let Some(addr) = (unsafe { sockaddr_ip(ifa.ifa_addr) }) else {
            continue;
        };
        if let IpAddr::V6(v6) = addr {
            if v6.segments()[0] & 0xffc0 == 0xfe80 {
                continue;
            }
        }
        let full = if addr.is_ipv4() { 32 } else { 128 };
        let prefix_len = if ifa.ifa_netmask.is_null() {
            full
        } else {
            // SAFETY: a non-null netmask of the same family as the address.
            match unsafe { sockaddr_ip(ifa.ifa_netmask) } {
                Some(IpAddr::V4(m)) => u32::from(m).count_ones() as u8,
                Some(IpAddr::V6(m)) => u128::from(m).count_ones() as u8,
                None => full,
            }
        };
        // SAFETY: a non-null, NUL-terminated name.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        let flags = ifa.ifa_flags;
        out.push(Interface {
            name,
            addr,
            prefix_len,
            up: flags & libc::IFF_UP as libc::c_uint != 0,
            loopback: flags & libc::IFF_LOOPBACK as libc::c_uint != 0,
        });
    }
    drop(list);
    Ok(out)
}

/// The IP address in a `sockaddr`, if it is IPv4 or IPv6.
///
/// # Safety
///
/// `sa` must point to a valid `sockaddr` whose family tells its real size.
unsafe fn sockaddr_ip(sa: *const libc::sockaddr) -> Option<IpAddr> {
    match i32::from((*sa).sa_family) {
        libc::AF_INET => {
            let sin = std::ptr::read_unaligned(sa as *const libc::sockaddr_in);
            Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                sin.sin_addr.s_addr,
            ))))
        }
        libc::AF_INET6 => {
            let sin6 = std::ptr::read_unaligned(sa as *const libc::sockaddr_in6);
            Some(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)))
        }
        _ => None,
    }
}

/// Chooses this host's interface from the OS's list; see the module docs.
/// `spec` is `OXCCL_SOCKET_IFNAME`; `toward` is the master's address.
pub(crate) fn select_interface(spec: Option<&str>, toward: Option<IpAddr>) -> Result<Interface> {
    let list = list_interfaces().map_err(|e| Error::Bootstrap {
        context: "choosing a network interface".into(),
        detail: format!("cannot list the network interfaces: {e}"),
    })?;
    select_from(&list, spec, toward)
}

/// A parsed `OXCCL_SOCKET_IFNAME`.
struct Spec<'a> {
    exclude: bool,
    exact: bool,
    names: Vec<&'a str>,
}

impl<'a> Spec<'a> {
    fn parse(spec: &'a str) -> Spec<'a> {
        let mut rest = spec.trim();
        let exclude = rest.starts_with('^');
        if exclude {
            rest = &rest[1..];
        }
        let exact = rest.starts_with('=');
        if exact {
            rest = &rest[1..];
        }
        let names = rest
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .collect();
        Spec {
            exclude,
            exact,
            names,
        }
    }

    fn accepts(&self, name: &str) -> bool {
        let listed = self.names.iter().any(|n| {
            if self.exact {
                name == *n
            } else {
                name.starts_with(n)
            }
        });
        listed != self.exclude
    }
}

/// The first of `candidates` with an IPv4 address, else the first.
fn first_v4_then_v6<'a>(
    candidates: impl Iterator<Item = &'a Interface> + Clone,
) -> Option<&'a Interface> {
    candidates
        .clone()
        .find(|i| i.addr.is_ipv4())
        .or_else(|| candidates.clone().next())
}

/// [`select_interface`] over a given list (pure, for tests).
pub(crate) fn select_from(
    list: &[Interface],
    spec: Option<&str>,
    toward: Option<IpAddr>,
) -> Result<Interface> {
    let up = || list.iter().filter(|i| i.up);
    if let Some(spec_text) = spec.filter(|s| !s.trim().is_empty()) {
        let parsed = Spec::parse(spec_text);
        return first_v4_then_v6(up().filter(|i| parsed.accepts(&i.name)))
            .cloned()
            .ok_or_else(|| Error::Config {
                name: "OXCCL_SOCKET_IFNAME".into(),
                value: spec_text.into(),
                reason: format!(
                    "no interface that is up matches; interfaces here: {}",
                    describe(list)
                ),
            });
    }
    if let Some(target) = toward {
        if target.is_loopback() {
            let same_family = up().find(|i| i.loopback && i.addr.is_ipv4() == target.is_ipv4());
            if let Some(lo) = same_family.or_else(|| up().find(|i| i.loopback)) {
                return Ok(lo.clone());
            }
        }
        // Longest prefix first, as routing would; the OS order breaks ties.
        let mut best: Option<&Interface> = None;
        for i in up().filter(|i| i.contains(target)) {
            if best.is_none_or(|b| i.prefix_len > b.prefix_len) {
                best = Some(i);
            }
        }
        if let Some(best) = best {
            return Ok(best.clone());
        }
    }
    first_v4_then_v6(up().filter(|i| !i.loopback && !i.is_virtual_bridge()))
        .or_else(|| first_v4_then_v6(up().filter(|i| !i.loopback)))
        .or_else(|| first_v4_then_v6(up()))
        .cloned()
        .ok_or_else(|| Error::Bootstrap {
            context: "choosing a network interface".into(),
            detail: format!("no interface is up; interfaces here: {}", describe(list)),
        })
}

/// `lo 127.0.0.1, eth0 10.0.0.2, eth1 10.1.0.2 (down)`.
fn describe(list: &[Interface]) -> String {
    if list.is_empty() {
        return "none".into();
    }
    list.iter()
        .map(|i| {
            let down = if i.up { "" } else { " (down)" };
            format!("{} {}{down}", i.name, i.addr)
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iface(name: &str, addr: &str, prefix_len: u8) -> Interface {
        let addr: IpAddr = addr.parse().unwrap();
        Interface {
            name: name.into(),
            addr,
            prefix_len,
            up: true,
            loopback: name == "lo",
        }
    }

    fn down(mut i: Interface) -> Interface {
        i.up = false;
        i
    }

    fn host() -> Vec<Interface> {
        vec![
            iface("lo", "127.0.0.1", 8),
            iface("lo", "::1", 128),
            iface("docker0", "172.17.0.1", 16),
            iface("eth0", "fd00::2", 64),
            iface("eth0", "10.0.0.2", 24),
            iface("eth1", "10.1.0.2", 16),
            iface("ib0", "192.168.5.2", 24),
            down(iface("eth2", "10.2.0.2", 24)),
        ]
    }

    fn pick(spec: Option<&str>, toward: Option<&str>) -> (String, String) {
        let toward = toward.map(|t| t.parse().unwrap());
        let i = select_from(&host(), spec, toward).unwrap();
        (i.name, i.addr.to_string())
    }

    fn p(name: &str, addr: &str) -> (String, String) {
        (name.into(), addr.into())
    }

    #[test]
    fn spec_parsing() {
        let s = Spec::parse("eth,ib");
        assert!(!s.exclude && !s.exact);
        assert!(s.accepts("eth0") && s.accepts("ib1") && !s.accepts("lo"));
        let s = Spec::parse("^docker,lo");
        assert!(s.exclude && !s.exact);
        assert!(!s.accepts("docker0") && !s.accepts("lo") && s.accepts("eth0"));
        let s = Spec::parse("=eth0");
        assert!(s.exact && s.accepts("eth0") && !s.accepts("eth01"));
        let s = Spec::parse("^=docker0");
        assert!(s.exclude && s.exact);
        assert!(!s.accepts("docker0") && s.accepts("docker1"));
        let s = Spec::parse(" eth0 , ,ib ");
        assert_eq!(s.names, vec!["eth0", "ib"]);
    }

    #[test]
    fn with_a_spec() {
        // IPv4 before IPv6 on the same interface, whatever the OS order.
        assert_eq!(pick(Some("eth"), None), p("eth0", "10.0.0.2"));
        assert_eq!(
            pick(Some("ib,eth"), None),
            p("eth0", "10.0.0.2"),
            "OS order"
        );
        assert_eq!(pick(Some("=eth1"), None), p("eth1", "10.1.0.2"));
        assert_eq!(pick(Some("^docker,lo,eth"), None), p("ib0", "192.168.5.2"));
        assert_eq!(pick(Some("^=lo"), None), p("docker0", "172.17.0.1"));
        // A spec overrides the subnet rule.
        assert_eq!(pick(Some("ib"), Some("10.1.3.4")), p("ib0", "192.168.5.2"));
        // Only an IPv6 address on the matching interface.
        let list = vec![iface("eth0", "fd00::2", 64), iface("lo", "127.0.0.1", 8)];
        assert_eq!(
            select_from(&list, Some("eth"), None)
                .unwrap()
                .addr
                .to_string(),
            "fd00::2"
        );
        // An empty spec is no spec.
        assert_eq!(pick(Some(""), None), p("eth0", "10.0.0.2"));
    }

    #[test]
    fn a_spec_that_matches_nothing_lists_the_interfaces() {
        for spec in ["=eth", "eth2", "wlan", "^lo,docker,eth,ib"] {
            let e = select_from(&host(), Some(spec), None).unwrap_err();
            let Error::Config {
                name,
                value,
                reason,
            } = &e
            else {
                panic!("{e}");
            };
            assert_eq!(name, "OXCCL_SOCKET_IFNAME");
            assert_eq!(value, spec);
            assert!(reason.contains("no interface"), "{reason}");
            assert!(
                reason.contains(
                    "lo 127.0.0.1, lo ::1, docker0 172.17.0.1, eth0 fd00::2, eth0 10.0.0.2"
                ),
                "{reason}"
            );
            assert!(reason.contains("eth2 10.2.0.2 (down)"), "{reason}");
        }
    }

    #[test]
    fn toward_the_master() {
        assert_eq!(pick(None, Some("10.1.200.7")), p("eth1", "10.1.0.2"));
        assert_eq!(pick(None, Some("192.168.5.9")), p("ib0", "192.168.5.2"));
        assert_eq!(pick(None, Some("fd00::9")), p("eth0", "fd00::2"));
        assert_eq!(pick(None, Some("127.0.0.1")), p("lo", "127.0.0.1"));
        assert_eq!(pick(None, Some("::1")), p("lo", "::1"));
        // A down interface's subnet does not count.
        assert_eq!(pick(None, Some("10.2.0.9")), p("eth0", "10.0.0.2"));
        // Elsewhere: the default rule.
        assert_eq!(pick(None, Some("8.8.8.8")), p("eth0", "10.0.0.2"));
        // Longest prefix wins among overlapping subnets.
        let list = vec![
            iface("wide", "10.0.0.1", 8),
            iface("narrow", "10.5.0.1", 16),
        ];
        let i = select_from(&list, None, Some("10.5.1.1".parse().unwrap())).unwrap();
        assert_eq!(i.name, "narrow");
        // A /0 matches nothing.
        assert!(!iface("tun0", "10.9.0.1", 0).contains("1.2.3.4".parse().unwrap()));
        assert!(iface("tun0", "10.9.0.1", 32).contains("10.9.0.1".parse().unwrap()));
        assert!(!iface("tun0", "10.9.0.1", 32).contains("10.9.0.2".parse().unwrap()));
        assert!(!iface("eth0", "10.0.0.2", 24).contains("fd00::2".parse().unwrap()));
    }

    #[test]
    fn defaults() {
        assert_eq!(pick(None, None), p("eth0", "10.0.0.2"));
        let bridges_and_lo = vec![
            iface("lo", "127.0.0.1", 8),
            iface("virbr0", "192.168.122.1", 24),
            iface("docker0", "172.17.0.1", 16),
        ];
        assert_eq!(
            select_from(&bridges_and_lo, None, None).unwrap().name,
            "virbr0"
        );
        let lo_only = vec![iface("lo", "::1", 128), iface("lo", "127.0.0.1", 8)];
        assert_eq!(
            select_from(&lo_only, None, None).unwrap().addr.to_string(),
            "127.0.0.1"
        );
        let v6_first = vec![iface("eth0", "fd00::2", 64), iface("eth1", "10.1.0.2", 16)];
        assert_eq!(select_from(&v6_first, None, None).unwrap().name, "eth1");
        let nothing_up = vec![down(iface("eth0", "10.0.0.2", 24))];
        let e = select_from(&nothing_up, None, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no interface is up"), "{e}");
        assert!(select_from(&[], None, None).is_err());
    }

    #[test]
    fn the_os_lists_loopback() {
        let list = list_interfaces().unwrap();
        assert!(
            list.iter().any(|i| i.name == "lo" && i.loopback && i.up),
            "{list:?}"
        );
        let lo = list
            .iter()
            .find(|i| i.addr == IpAddr::V4(Ipv4Addr::LOCALHOST))
            .unwrap();
        assert_eq!(lo.prefix_len, 8);
        assert!(list
            .iter()
            .all(|i| !matches!(i.addr, IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80)));
        let chosen = select_interface(None, Some("127.0.0.1".parse().unwrap())).unwrap();
        assert!(chosen.loopback);
    }
}
