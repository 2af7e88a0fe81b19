//! The cross-core mesh: one bounded channel for every ordered pair of cores.
//!
//! Channels are created up front on the starting thread and each end is moved to its
//! core and connected there. Sends wait for room (backpressure), never grow a queue
//! without bound; `try_send` reports a full channel so a caller can refuse instead of
//! wait. Payloads cross as they are: large ones should be reference-counted `Bytes`,
//! never copies. What a dropped message means is documented by each message kind where
//! it is defined (in the broker), next to the code that decides to drop it.

use glommio::channels::shared_channel::{
    self, ConnectedReceiver, ConnectedSender, SharedReceiver, SharedSender,
};

use crate::cores::CoreId;

/// Why a message was not sent; the message comes back.
#[derive(Debug)]
pub enum SendError<T> {
    /// The channel is full (`try_send` only).
    Full(T),
    /// The receiving core is gone.
    Closed(T),
    /// No channel to that core (itself, or out of range).
    NoRoute(T),
}

impl<T> SendError<T> {
    /// The message that was not sent.
    pub fn into_inner(self) -> T {
        match self {
            SendError::Full(t) | SendError::Closed(t) | SendError::NoRoute(t) => t,
        }
    }
}

/// Both ends of every channel, before they are moved to their cores.
pub struct MeshBuilder<T: Send + 'static> {
    ends: Vec<Option<MeshEnds<T>>>,
}

impl<T: Send + 'static> std::fmt::Debug for MeshBuilder<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeshBuilder")
            .field("cores", &self.ends.len())
            .finish()
    }
}

/// One core's ends, not yet connected (`Send`: move it to its core).
pub struct MeshEnds<T: Send + 'static> {
    core: CoreId,
    to: Vec<Option<SharedSender<T>>>,
    from: Vec<Option<SharedReceiver<T>>>,
}

impl<T: Send + 'static> std::fmt::Debug for MeshEnds<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeshEnds")
            .field("core", &self.core)
            .finish()
    }
}

impl<T: Send + 'static> MeshBuilder<T> {
    /// Channels of `capacity` messages between every ordered pair of `cores` cores.
    pub fn new(cores: usize, capacity: usize) -> Self {
        let mut to: Vec<Vec<Option<SharedSender<T>>>> = (0..cores)
            .map(|_| (0..cores).map(|_| None).collect())
            .collect();
        let mut from: Vec<Vec<Option<SharedReceiver<T>>>> = (0..cores)
            .map(|_| (0..cores).map(|_| None).collect())
            .collect();
        for a in 0..cores {
            for b in 0..cores {
                if a != b {
                    let (s, r) = shared_channel::new_bounded(capacity);
                    to[a][b] = Some(s);
                    from[b][a] = Some(r);
                }
            }
        }
        let ends = to
            .into_iter()
            .zip(from)
            .enumerate()
            .map(|(i, (to, from))| {
                Some(MeshEnds {
                    core: CoreId(i),
                    to,
                    from,
                })
            })
            .collect();
        MeshBuilder { ends }
    }

    /// Takes core `core`'s ends (once).
    pub fn take(&mut self, core: CoreId) -> MeshEnds<T> {
        self.ends[core.0]
            .take()
            .expect("each core's mesh ends are taken once")
    }
}

impl<T: Send + 'static> MeshEnds<T> {
    /// Connects this core's ends; must run on the core's executor. Each end's connect
    /// waits for its peer's, so they all run at once (in sequence, two cores connecting
    /// their senders first would wait on each other forever).
    pub async fn connect(self) -> Mesh<T> {
        let senders: Vec<_> = self
            .to
            .into_iter()
            .map(|s| s.map(|s| glommio::spawn_local(s.connect())))
            .collect();
        let receivers: Vec<_> = self
            .from
            .into_iter()
            .enumerate()
            .filter_map(|(i, r)| r.map(|r| (CoreId(i), glommio::spawn_local(r.connect()))))
            .collect();
        let mut to = Vec::with_capacity(senders.len());
        for s in senders {
            to.push(match s {
                Some(task) => Some(task.await),
                None => None,
            });
        }
        let mut from = Vec::with_capacity(receivers.len());
        for (core, task) in receivers {
            from.push((core, task.await));
        }
        Mesh {
            core: self.core,
            to,
            from,
        }
    }
}

/// One core's connected ends of the mesh.
pub struct Mesh<T: Send + 'static> {
    core: CoreId,
    to: Vec<Option<ConnectedSender<T>>>,
    from: Vec<(CoreId, ConnectedReceiver<T>)>,
}

impl<T: Send + 'static> std::fmt::Debug for Mesh<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mesh").field("core", &self.core).finish()
    }
}

impl<T: Send + 'static> Mesh<T> {
    /// This core.
    pub fn core(&self) -> CoreId {
        self.core
    }

    /// Number of cores in the mesh.
    pub fn cores(&self) -> usize {
        self.to.len()
    }

    /// Sends to `to`, waiting for room.
    pub async fn send(&self, to: CoreId, msg: T) -> Result<(), SendError<T>> {
        match self.to.get(to.0) {
            Some(Some(s)) => s.send(msg).await.map_err(|e| match e {
                glommio::GlommioError::Closed(glommio::ResourceType::Channel(m)) => {
                    SendError::Closed(m)
                }
                glommio::GlommioError::WouldBlock(glommio::ResourceType::Channel(m)) => {
                    SendError::Full(m)
                }
                _ => unreachable!("a channel send fails only as closed or full"),
            }),
            _ => Err(SendError::NoRoute(msg)),
        }
    }

    /// Sends to `to` if there is room now.
    pub fn try_send(&self, to: CoreId, msg: T) -> Result<(), SendError<T>> {
        match self.to.get(to.0) {
            Some(Some(s)) => s.try_send(msg).map_err(|e| match e {
                glommio::GlommioError::Closed(glommio::ResourceType::Channel(m)) => {
                    SendError::Closed(m)
                }
                glommio::GlommioError::WouldBlock(glommio::ResourceType::Channel(m)) => {
                    SendError::Full(m)
                }
                _ => unreachable!("a channel send fails only as closed or full"),
            }),
            _ => Err(SendError::NoRoute(msg)),
        }
    }

    /// Takes the receiving ends (once): the core's inbox loop owns them.
    pub fn take_receivers(&mut self) -> Vec<(CoreId, Inbox<T>)> {
        std::mem::take(&mut self.from)
            .into_iter()
            .map(|(c, r)| (c, Inbox(r)))
            .collect()
    }

    /// Closes this core's sending ends: peers' receivers end once drained.
    pub fn close(&self) {
        for s in self.to.iter().flatten() {
            s.close();
        }
    }
}

/// The receiving end of one peer's channel.
pub struct Inbox<T: Send + 'static>(ConnectedReceiver<T>);

impl<T: Send + 'static> std::fmt::Debug for Inbox<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Inbox")
    }
}

impl<T: Send + 'static> Inbox<T> {
    /// The next message; `None` once the sender closed and everything was received.
    pub async fn recv(&self) -> Option<T> {
        self.0.recv().await
    }
}

/// A request that carries the channel to answer it on; the answer may be sent from
/// any core.
#[derive(Debug)]
pub struct Request<Q, R> {
    /// The question.
    pub body: Q,
    /// Where the answer goes. Dropping it unanswered makes the asker's wait fail.
    pub reply: futures_channel::oneshot::Sender<R>,
}

/// Builds a request and the future of its answer.
pub fn request<Q, R>(body: Q) -> (Request<Q, R>, futures_channel::oneshot::Receiver<R>) {
    let (reply, rx) = futures_channel::oneshot::channel();
    (Request { body, reply }, rx)
}
