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
        }))
    }

    /// Sends `data` to `dest` without blocking, as one datagram or (with `segment`) a GSO
    /// burst. `Ok(false)` when the socket buffer is full.
    pub(crate) fn try_send(
        &self,
        data: &[u8],
        dest: SocketAddr,
        segment: Option<usize>,
    ) -> io::Result<bool> {
        let segment = segment.filter(|s| *s < data.len());
        if segment.is_some() && !self.gso.get() {
            for piece in data.chunks(segment.unwrap_or(data.len())) {
                if !self.send_one(piece, dest, None)? {
                    return Ok(false);
                }
            }
            return Ok(true);
        }
        match self.send_one(data, dest, segment) {
            Err(e) if segment.is_some() && e.raw_os_error() == Some(libc::EIO) => {
                // The device cannot segment: stop asking, send this burst piece by piece.
                self.gso.set(false);
                self.try_send(data, dest, segment)
            }
            other => other,
        }
    }

    fn send_one(&self, data: &[u8], dest: SocketAddr, segment: Option<usize>) -> io::Result<bool> {
        let addr = SockAddr::from(dest);
        let mut iov = libc::iovec {
            iov_base: data.as_ptr() as *mut libc::c_void,
            iov_len: data.len(),
        };
        let mut control = [0u64; 4];
        // SAFETY: plain-old-data struct.
        let mut msg: libc::msghdr = unsafe { zeroed() };
        msg.msg_name = addr.as_ptr() as *mut libc::c_void;
        msg.msg_namelen = addr.len();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if let Some(seg) = segment {
            msg.msg_control = control.as_mut_ptr().cast();
            // SAFETY: CMSG_SPACE is a pure size computation.
            msg.msg_controllen = unsafe { libc::CMSG_SPACE(size_of::<u16>() as u32) } as usize;
            // SAFETY: the control buffer is large enough for one u16 control message.
            unsafe {
                let cmsg = libc::CMSG_FIRSTHDR(&msg);
                (*cmsg).cmsg_level = libc::SOL_UDP;
                (*cmsg).cmsg_type = libc::UDP_SEGMENT;
                (*cmsg).cmsg_len = libc::CMSG_LEN(size_of::<u16>() as u32) as usize;
                std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<u16>(), seg as u16);
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

    /// Sends, waiting for room when the socket buffer is full.
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
