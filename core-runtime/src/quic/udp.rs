//! One UDP socket per core, with the syscalls glommio's UDP API does not offer.
//!
//! - Receive: a pending `peek_from` on glommio's socket signals readability (peeking
//!   consumes nothing, so dropping or keeping that future never loses a datagram), then
//!   non-blocking `recvmsg` drains the queue, with GRO so one call can return many
//!   coalesced datagrams and their segment size.
//! - Send: non-blocking `sendmsg` with `UDP_SEGMENT` (GSO) so one call sends a burst of
//!   equal-size datagrams; if the kernel refuses GSO we fall back to one datagram per
//!   call for the rest of the socket's life.
//! - `SO_REUSEPORT` lets every core bind the same port; the kernel hashes each client's
//!   4-tuple to one core's socket, so a connection stays on the core that accepted it.
//! - `IP_MTU_DISCOVER = IP_PMTUDISC_PROBE` lets quinn's path-MTU discovery send probes.
//! - ECN: the TOS / traffic-class byte is read on receive (`IP_RECVTOS`,
//!   `IPV6_RECVTCLASS`) and set per send (`IP_TOS`, `IPV6_TCLASS` control messages), so
//!   quinn-proto can validate ECN on a path and react to congestion marks before loss.
//!   Sends that had to wait for socket room go without a mark.

use std::cell::Cell;
use std::io;
use std::mem::{size_of, zeroed};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, RawFd};
use std::rc::Rc;

use socket2::{Domain, Protocol, SockAddr, Socket, Type};

/// Kernel socket buffer size we ask for (the kernel caps it at `net.core.rmem_max`).
const SOCKET_BUFFER_BYTES: usize = 4 << 20;

/// A received datagram (or GRO-coalesced run of them).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Received {
    pub len: usize,
    pub from: SocketAddr,
    /// Size of each coalesced datagram; `None` when the buffer holds one.
    pub segment: Option<usize>,
    /// The ECN bits it arrived with.
    pub ecn: Option<quinn_proto::EcnCodepoint>,
}

#[derive(Debug)]
pub(crate) struct UdpIo {
    sock: Rc<glommio::net::UdpSocket>,
    fd: RawFd,
    gso: Cell<bool>,
    local: SocketAddr,
}

fn setsockopt_int(
    fd: RawFd,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> io::Result<()> {
    // SAFETY: the pointer and length describe a live c_int.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&value as *const libc::c_int).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

impl UdpIo {
    /// Binds `addr` (with `SO_REUSEPORT` when `reuse_port`). Must run on a glommio
    /// executor.
    pub(crate) fn bind(addr: SocketAddr, reuse_port: bool) -> io::Result<UdpIo> {
        let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
        if reuse_port {
            socket.set_reuse_port(true)?;
        }
        socket.set_nonblocking(true)?;
        let _ = socket.set_recv_buffer_size(SOCKET_BUFFER_BYTES);
        let _ = socket.set_send_buffer_size(SOCKET_BUFFER_BYTES);
        socket.bind(&SockAddr::from(addr))?;
        let fd = socket.as_raw_fd();
        match addr {
            SocketAddr::V4(_) => {
                let _ = setsockopt_int(
                    fd,
                    libc::IPPROTO_IP,
                    libc::IP_MTU_DISCOVER,
                    libc::IP_PMTUDISC_PROBE,
                );
            }
            SocketAddr::V6(_) => {
                let _ = setsockopt_int(
                    fd,
                    libc::IPPROTO_IPV6,
                    libc::IPV6_MTU_DISCOVER,
                    libc::IPV6_PMTUDISC_PROBE,
                );
            }
        }
        // Report each datagram's TOS / traffic class (ECN bits) on receive.
        let _ = match addr {
            SocketAddr::V4(_) => setsockopt_int(fd, libc::IPPROTO_IP, libc::IP_RECVTOS, 1),
            SocketAddr::V6(_) => setsockopt_int(fd, libc::IPPROTO_IPV6, libc::IPV6_RECVTCLASS, 1),
        };
        // GRO is an optimisation: a kernel without it just delivers single datagrams.
        let _ = setsockopt_int(fd, libc::SOL_UDP, libc::UDP_GRO, 1);
        let local = socket
            .local_addr()?
            .as_socket()
            .ok_or_else(|| io::Error::other("bound socket has no IP address"))?;
        let raw = socket.into_raw_fd();
        // SAFETY: `raw` is a bound UDP socket we own; glommio takes ownership of it.
        let sock = unsafe { glommio::net::UdpSocket::from_raw_fd(raw) };
        Ok(UdpIo {
            sock: Rc::new(sock),
            fd: raw,
            gso: Cell::new(true),
            local,
        })
    }

    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Resolves when a datagram is waiting. Owns what it borrows, so it can be kept
    /// across loop iterations.
    pub(crate) fn readable(&self) -> impl std::future::Future<Output = io::Result<()>> + 'static {
        let sock = self.sock.clone();
        async move {
            let mut byte = [0u8; 1];
            sock.peek_from(&mut byte)
                .await
                .map(|_| ())
                .map_err(|e| io::Error::other(e.to_string()))
        }
    }

    /// Receives one datagram (or GRO run) without blocking; `Ok(None)` when none waits.
    pub(crate) fn try_recv(&self, buf: &mut [u8]) -> io::Result<Option<Received>> {
        // SAFETY: plain-old-data structs, zero is a valid initial value.
        let mut addr: libc::sockaddr_storage = unsafe { zeroed() };
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        let mut control = [0u64; 8];
        // SAFETY: as above.
        let mut msg: libc::msghdr = unsafe { zeroed() };
        msg.msg_name = (&mut addr as *mut libc::sockaddr_storage).cast();
        msg.msg_namelen = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = size_of::<[u64; 8]>();
        // SAFETY: msg points at live buffers sized as declared.
        let n = unsafe { libc::recvmsg(self.fd, &mut msg, libc::MSG_DONTWAIT) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock => Ok(None),
                io::ErrorKind::Interrupted => Ok(None),
                _ => Err(e),
            };
        }
        let mut segment = None;
        let mut tos: Option<u8> = None;
        // SAFETY: walking the control messages the kernel wrote into `control`.
        unsafe {
            let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
            while !cmsg.is_null() {
                let c = &*cmsg;
                if c.cmsg_level == libc::SOL_UDP && c.cmsg_type == libc::UDP_GRO {
                    let size =
                        std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>());
                    if size > 0 && (size as usize) < n as usize {
                        segment = Some(size as usize);
                    }
                } else if c.cmsg_level == libc::IPPROTO_IP && c.cmsg_type == libc::IP_TOS {
                    tos = Some(std::ptr::read_unaligned(libc::CMSG_DATA(cmsg)));
                } else if c.cmsg_level == libc::IPPROTO_IPV6 && c.cmsg_type == libc::IPV6_TCLASS {
                    let v = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>());
                    tos = Some(v as u8);
                }
                cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
            }
        }
        // SAFETY: the kernel filled `addr` with `msg_namelen` bytes of a socket address.
        let from = unsafe { SockAddr::new(addr, msg.msg_namelen) }
            .as_socket()
            .ok_or_else(|| io::Error::other("datagram from a non-IP address"))?;
        Ok(Some(Received {
            len: n as usize,
            from,
            segment,
            ecn: tos.and_then(|t| quinn_proto::EcnCodepoint::from_bits(t & 0b11)),
        }))
    }

    /// Sends `data` to `dest` without blocking, as one datagram or (with `segment`) a GSO
    /// burst. The bytes taken: all, or when the socket buffer is full 0, or (a burst
    /// sent piece by piece, without GSO) the pieces that went out before it filled.
    pub(crate) fn try_send(
        &self,
        data: &[u8],
        dest: SocketAddr,
        segment: Option<usize>,
        ecn: Option<quinn_proto::EcnCodepoint>,
    ) -> io::Result<usize> {
        let segment = segment.filter(|s| *s < data.len());
        if let Some(step) = segment
            && !self.gso.get()
        {
            return send_pieces(data, step, |piece| self.send_one(piece, dest, None, ecn));
        }
        let whole = |sent: bool| if sent { data.len() } else { 0 };
        match self.send_one(data, dest, segment, ecn).map(whole) {
            Err(e) if segment.is_some() && e.raw_os_error() == Some(libc::EIO) => {
                // The device cannot segment: stop asking, send this burst piece by piece.
                self.gso.set(false);
                self.try_send(data, dest, segment, ecn)
            }
            other => other,
        }
    }

    fn send_one(
        &self,
        data: &[u8],
        dest: SocketAddr,
        segment: Option<usize>,
        ecn: Option<quinn_proto::EcnCodepoint>,
    ) -> io::Result<bool> {
        let addr = SockAddr::from(dest);
        let mut iov = libc::iovec {
            iov_base: data.as_ptr() as *mut libc::c_void,
            iov_len: data.len(),
        };
        let mut control = [0u64; 8];
        // SAFETY: plain-old-data struct.
        let mut msg: libc::msghdr = unsafe { zeroed() };
        msg.msg_name = addr.as_ptr() as *mut libc::c_void;
        msg.msg_namelen = addr.len();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        // SAFETY: CMSG_SPACE is a pure size computation.
        let (seg_space, int_space) = unsafe {
            (
                libc::CMSG_SPACE(size_of::<u16>() as u32) as usize,
                libc::CMSG_SPACE(size_of::<libc::c_int>() as u32) as usize,
            )
        };
        let space = segment.map_or(0, |_| seg_space) + ecn.map_or(0, |_| int_space);
        if space > 0 {
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = space;
            // SAFETY: the control buffer (64 bytes) holds both messages (24 + 24 bytes),
            // and CMSG_NXTHDR walks within the length set just above.
            unsafe {
                let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
                if let Some(seg) = segment {
                    (*cmsg).cmsg_level = libc::SOL_UDP;
                    (*cmsg).cmsg_type = libc::UDP_SEGMENT;
                    (*cmsg).cmsg_len = libc::CMSG_LEN(size_of::<u16>() as u32) as usize;
                    std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<u16>(), seg as u16);
                    cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
                }
                if let Some(ecn) = ecn {
                    let (level, kind) = match dest {
                        SocketAddr::V4(_) => (libc::IPPROTO_IP, libc::IP_TOS),
                        SocketAddr::V6(_) => (libc::IPPROTO_IPV6, libc::IPV6_TCLASS),
                    };
                    (*cmsg).cmsg_level = level;
                    (*cmsg).cmsg_type = kind;
                    (*cmsg).cmsg_len = libc::CMSG_LEN(size_of::<libc::c_int>() as u32) as usize;
                    std::ptr::write_unaligned(
                        libc::CMSG_DATA(cmsg).cast::<libc::c_int>(),
                        libc::c_int::from(ecn as u8),
                    );
                }
            }
        }
        loop {
            // SAFETY: msg points at live buffers sized as declared.
            let n = unsafe { libc::sendmsg(self.fd, &msg, libc::MSG_DONTWAIT) };
            if n >= 0 {
                return Ok(true);
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => return Ok(false),
                _ => {
                    // A datagram to an unreachable peer or too large for the path must
                    // not stop the endpoint: QUIC treats it as lost.
                    if matches!(
                        e.raw_os_error(),
                        Some(
                            libc::ECONNREFUSED
                                | libc::EHOSTUNREACH
                                | libc::ENETUNREACH
                                | libc::EMSGSIZE
                                | libc::EPERM
                        )
                    ) {
                        return Ok(true);
                    }
                    return Err(e);
                }
            }
        }
    }

    /// Sends, waiting for room when the socket buffer is full (`data` is what
    /// [`UdpIo::try_send`] did not take).
    pub(crate) async fn send_waiting(
        &self,
        data: &[u8],
        dest: SocketAddr,
        segment: Option<usize>,
    ) -> io::Result<()> {
        let step = segment.unwrap_or(data.len()).max(1);
        for piece in data.chunks(step) {
            self.sock
                .send_to(piece, dest)
                .await
                .map_err(|e| io::Error::other(e.to_string()))?;
        }
        Ok(())
    }
}

/// Sends `data` as `step`-sized datagrams through `send` (false: the socket is full),
/// stopping at the first the socket refuses: returns the bytes that went out, so the
/// caller queues only the rest. An error partway loses the rest of the burst (QUIC
/// takes it as lost).
fn send_pieces(
    data: &[u8],
    step: usize,
    mut send: impl FnMut(&[u8]) -> io::Result<bool>,
) -> io::Result<usize> {
    let mut sent = 0;
    for piece in data.chunks(step.max(1)) {
        if !send(piece)? {
            break;
        }
        sent += piece.len();
    }
    Ok(sent)
}

#[cfg(test)]
mod tests {
    use super::*;
    use quinn_proto::EcnCodepoint;

    /// A burst sent piece by piece into a socket that fills partway reports the bytes of
    /// the pieces that went, stopping at the first refused.
    #[test]
    fn a_burst_sent_piece_by_piece_reports_the_pieces_that_went() {
        let data: Vec<u8> = (0..10u8).collect();
        let mut went = Vec::new();
        let mut room = 2;
        let sent = send_pieces(&data, 4, |piece| {
            if room == 0 {
                return Ok(false);
            }
            room -= 1;
            went.push(piece.to_vec());
            Ok(true)
        })
        .unwrap();
        assert_eq!(sent, 8);
        assert_eq!(went, [vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
        assert_eq!(send_pieces(&data, 4, |_| Ok(true)).unwrap(), 10);
    }

    #[test]
    fn ecn_marks_travel_through_the_kernel_both_ways() {
        crate::task::block_on(async {
            let a = UdpIo::bind("127.0.0.1:0".parse().unwrap(), false).unwrap();
            let b = UdpIo::bind("127.0.0.1:0".parse().unwrap(), false).unwrap();
            let mut buf = vec![0u8; 65536];
            for mark in [
                Some(EcnCodepoint::Ect0),
                Some(EcnCodepoint::Ect1),
                Some(EcnCodepoint::Ce),
                None,
            ] {
                assert_eq!(a.try_send(b"hello", b.local_addr(), None, mark).unwrap(), 5);
                b.readable().await.unwrap();
                let r = b.try_recv(&mut buf).unwrap().expect("a datagram");
                assert_eq!(&buf[..r.len], b"hello");
                assert_eq!(r.ecn, mark, "sent {mark:?}");
            }
            // A GSO burst keeps its mark on every segment.
            let burst = vec![7u8; 3000];
            assert_eq!(
                a.try_send(&burst, b.local_addr(), Some(1000), Some(EcnCodepoint::Ect0))
                    .unwrap(),
                3000
            );
            let mut got = 0;
            while got < 3000 {
                b.readable().await.unwrap();
                let r = b.try_recv(&mut buf).unwrap().expect("a datagram");
                assert_eq!(r.ecn, Some(EcnCodepoint::Ect0));
                got += r.len;
            }
        });
    }
}
