//! Harness-owned proxies that put faults on links: UDP for QUIC (client to broker and
//! broker to broker), TCP for HTTP (broker to control plane).
//!
//! Every proxy fronts one party and knows who sends to it: brokers' peer connections
//! leave from their internal listener's IP, `127.0.0.{10+i}` for `node-i`, and
//! everything else on loopback is a client. A [`Link`] from one party to another can
//! drop, delay (with jitter, which reorders), duplicate, or cut packets; cutting one
//! direction only is a one-way partition, and a cut also drops the packets a delay
//! still holds on that link. Rules change while traffic flows.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};

/// One end of a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Party {
    /// A client (anything on loopback that is not a broker's peer endpoint).
    Client,
    /// Broker `node-i`.
    Node(usize),
    /// The control plane.
    ControlPlane,
}

impl Party {
    /// The party sending from `ip`.
    pub fn of(ip: IpAddr) -> Party {
        match ip {
            IpAddr::V4(v4) if v4.octets()[..3] == [127, 0, 0] && v4.octets()[3] >= 10 => {
                Party::Node(usize::from(v4.octets()[3] - 10))
            }
            _ => Party::Client,
        }
    }

    /// The address broker `node-i`'s peer traffic leaves from.
    pub fn node_ip(i: usize) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(127, 0, 0, 10 + i as u8))
    }
}

impl std::fmt::Display for Party {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Party::Client => write!(f, "client"),
            Party::Node(i) => write!(f, "node-{i}"),
            Party::ControlPlane => write!(f, "controlplane"),
        }
    }
}

/// What happens to packets (or TCP chunks) on one directed link.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Link {
    /// Nothing passes (for TCP: connections are refused and open ones cut).
    pub cut: bool,
    /// Probability a packet is dropped.
    pub drop: f64,
    /// Probability a packet is sent twice.
    pub duplicate: f64,
    /// Fixed delay.
    pub delay: Duration,
    /// Extra uniform random delay up to this; packets overtake each other.
    pub jitter: Duration,
}

impl Link {
    /// A cut link.
    pub fn cut() -> Link {
        Link {
            cut: true,
            ..Link::default()
        }
    }
}

/// The rules of every link, shared by the proxies.
#[derive(Debug, Default)]
pub struct Rules {
    links: Mutex<HashMap<(Party, Party), Link>>,
    rng: Mutex<u64>,
}

impl Rules {
    /// Sets the link `from` -> `to`.
    pub fn set(&self, from: Party, to: Party, link: Link) {
        self.links.lock().expect("rules").insert((from, to), link);
    }

    /// Sets both directions.
    pub fn set_both(&self, a: Party, b: Party, link: Link) {
        self.set(a, b, link);
        self.set(b, a, link);
    }

    /// Every link back to normal.
    pub fn heal(&self) {
        self.links.lock().expect("rules").clear();
    }

    fn get(&self, from: Party, to: Party) -> Link {
        self.links
            .lock()
            .expect("rules")
            .get(&(from, to))
            .copied()
            .unwrap_or_default()
    }

    /// A uniform number in [0, 1).
    fn unit(&self) -> f64 {
        let mut s = self.rng.lock().expect("rng");
        // splitmix64
        *s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// What to do with one packet: how many copies, after what delay each.
    fn fate(&self, from: Party, to: Party) -> Vec<Duration> {
        let link = self.get(from, to);
        if link.cut || (link.drop > 0.0 && self.unit() < link.drop) {
            return Vec::new();
        }
        let copies = if link.duplicate > 0.0 && self.unit() < link.duplicate {
            2
        } else {
            1
        };
        (0..copies)
            .map(|_| link.delay + link.jitter.mul_f64(self.unit()))
            .collect()
    }
}

/// Sends `buf` to `to` on `socket` after each delay in `fate`. A packet held back is
/// lost if the link `link` is cut by the time it is due (a partition drops what is in
/// flight).
async fn deliver(
    socket: &Arc<UdpSocket>,
    buf: &[u8],
    to: SocketAddr,
    fate: Vec<Duration>,
    rules: &Arc<Rules>,
    link: (Party, Party),
) {
    for delay in fate {
        if delay.is_zero() {
            let _ = socket.send_to(buf, to).await;
        } else {
            let (socket, buf, rules) = (socket.clone(), buf.to_vec(), rules.clone());
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                if !rules.get(link.0, link.1).cut {
                    let _ = socket.send_to(&buf, to).await;
                }
            });
        }
    }
}

/// A UDP proxy in front of `owner` at `target`; returns the address it listens on.
/// Runs until the runtime it was spawned on stops.
pub async fn udp(
    owner: Party,
    target: SocketAddr,
    rules: Arc<Rules>,
) -> std::io::Result<SocketAddr> {
    let front = Arc::new(UdpSocket::bind("127.0.0.1:0").await?);
    let addr = front.local_addr()?;
    tokio::spawn(async move {
        let mut upstreams: HashMap<SocketAddr, Arc<UdpSocket>> = HashMap::new();
        let mut buf = vec![0u8; 65536];
        loop {
            let Ok((n, src)) = front.recv_from(&mut buf).await else {
                continue;
            };
            let from = Party::of(src.ip());
            let up = match upstreams.get(&src) {
                Some(u) => u.clone(),
                None => {
                    let Ok(u) = UdpSocket::bind("127.0.0.1:0").await else {
                        continue;
                    };
                    if u.connect(target).await.is_err() {
                        continue;
                    }
                    let u = Arc::new(u);
                    upstreams.insert(src, u.clone());
                    // Answers back to this source.
                    let (u2, front2, rules2) = (u.clone(), front.clone(), rules.clone());
                    tokio::spawn(async move {
                        let mut buf = vec![0u8; 65536];
                        loop {
                            match u2.recv(&mut buf).await {
                                Ok(n) => {
                                    let fate = rules2.fate(owner, from);
                                    deliver(&front2, &buf[..n], src, fate, &rules2, (owner, from))
                                        .await;
                                }
                                // A connected UDP socket reports the ICMP "port
                                // unreachable" of a target that was down (restarting)
                                // as a receive error: keep relaying once it is back.
                                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                            }
                        }
                    });
                    u
                }
            };
            for delay in rules.fate(from, owner) {
                if delay.is_zero() {
                    let _ = up.send(&buf[..n]).await;
                } else {
                    let (up, b, rules) = (up.clone(), buf[..n].to_vec(), rules.clone());
                    tokio::spawn(async move {
                        tokio::time::sleep(delay).await;
                        if !rules.get(from, owner).cut {
                            let _ = up.send(&b).await;
                        }
                    });
                }
            }
        }
    });
    Ok(addr)
}

/// A TCP proxy from `client` to `owner` at `target` (one per client, so a rule can cut
/// one broker from the control plane); returns the address it listens on.
pub async fn tcp(
    client: Party,
    owner: Party,
    target: SocketAddr,
    rules: Arc<Rules>,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((down, _)) = listener.accept().await {
            if rules.get(client, owner).cut || rules.get(owner, client).cut {
                drop(down);
                continue;
            }
            let Ok(up) = TcpStream::connect(target).await else {
                continue;
            };
            let (dr, dw) = down.into_split();
            let (ur, uw) = up.into_split();
            tokio::spawn(pipe(dr, uw, client, owner, rules.clone()));
            tokio::spawn(pipe(ur, dw, owner, client, rules.clone()));
        }
    });
    Ok(addr)
}

/// Copies `r` to `w` chunk by chunk under the link `from` -> `to`: a cut closes the
/// connection; drops are not possible on a byte stream, so they are ignored; delays
/// hold each chunk.
async fn pipe(
    mut r: tokio::net::tcp::OwnedReadHalf,
    mut w: tokio::net::tcp::OwnedWriteHalf,
    from: Party,
    to: Party,
    rules: Arc<Rules>,
) {
    let mut buf = vec![0u8; 16384];
    loop {
        let n = match r.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let link = rules.get(from, to);
        if link.cut {
            break;
        }
        let delay = link.delay + link.jitter.mul_f64(rules.unit());
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if w.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = w.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parties_by_source_address() {
        assert_eq!(Party::of("127.0.0.1".parse().unwrap()), Party::Client);
        assert_eq!(Party::of(Party::node_ip(2)), Party::Node(2));
    }

    #[tokio::test]
    async fn a_cut_link_drops_one_direction_only() {
        let rules = Arc::new(Rules::default());
        let echo = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let echo_addr = echo.local_addr().unwrap();
        tokio::spawn(async move {
            let mut b = [0u8; 64];
            while let Ok((n, from)) = echo.recv_from(&mut b).await {
                let _ = echo.send_to(&b[..n], from).await;
            }
        });
        let front = udp(Party::Node(1), echo_addr, rules.clone()).await.unwrap();
        let me = UdpSocket::bind(SocketAddr::new(Party::node_ip(0), 0))
            .await
            .unwrap();
        let ask = |msg: &'static [u8]| {
            let me = &me;
            async move {
                me.send_to(msg, front).await.unwrap();
                let mut b = [0u8; 64];
                tokio::time::timeout(Duration::from_millis(300), me.recv(&mut b))
                    .await
                    .ok()
                    .map(|r| b[..r.unwrap()].to_vec())
            }
        };
        assert_eq!(ask(b"one").await.as_deref(), Some(&b"one"[..]));
        // Answers cut: the request arrives, the echo does not come back.
        rules.set(Party::Node(1), Party::Node(0), Link::cut());
        assert_eq!(ask(b"two").await, None);
        // Another party is unaffected.
        let other = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        other.send_to(b"three", front).await.unwrap();
        let mut b = [0u8; 64];
        let n = tokio::time::timeout(Duration::from_secs(1), other.recv(&mut b))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&b[..n], b"three");
        rules.heal();
        assert_eq!(ask(b"four").await.as_deref(), Some(&b"four"[..]));
    }

    #[tokio::test]
    async fn answers_flow_again_after_the_target_restarts() {
        let rules = Arc::new(Rules::default());
        let echo = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let target = echo.local_addr().unwrap();
        let front = udp(Party::Node(1), target, rules).await.unwrap();
        let me = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        // The target is down: the proxy's upstream gets "port unreachable".
        drop(echo);
        me.send_to(b"lost", front).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        // It comes back on the same port and answers.
        let echo = UdpSocket::bind(target).await.unwrap();
        tokio::spawn(async move {
            let mut b = [0u8; 64];
            while let Ok((n, from)) = echo.recv_from(&mut b).await {
                let _ = echo.send_to(&b[..n], from).await;
            }
        });
        me.send_to(b"back", front).await.unwrap();
        let mut b = [0u8; 64];
        let n = tokio::time::timeout(Duration::from_secs(1), me.recv(&mut b))
            .await
            .expect("the answer is relayed")
            .unwrap();
        assert_eq!(&b[..n], b"back");
    }

    #[tokio::test]
    async fn duplicates_arrive_twice() {
        let rules = Arc::new(Rules::default());
        let sink = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let front = udp(Party::Node(0), sink.local_addr().unwrap(), rules.clone())
            .await
            .unwrap();
        rules.set(
            Party::Client,
            Party::Node(0),
            Link {
                duplicate: 1.0,
                ..Link::default()
            },
        );
        let me = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        me.send_to(b"x", front).await.unwrap();
        let mut b = [0u8; 8];
        for _ in 0..2 {
            tokio::time::timeout(Duration::from_secs(1), sink.recv(&mut b))
                .await
                .unwrap()
                .unwrap();
        }
    }
}
