//! TEMPORARY stand-in until the interface selection lands (branch `store`).
use std::net::{IpAddr, Ipv4Addr};

pub(crate) struct Interface {
    pub name: String,
    pub addr: IpAddr,
}

pub(crate) fn select_interface(
    _spec: Option<&str>,
    toward: Option<IpAddr>,
) -> crate::Result<Interface> {
    Ok(Interface {
        name: "lo".into(),
        addr: toward.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)),
    })
}
