//! The handshake: the first frame of a client stream, and the time at which it is
//! checked, become a [`Session`] or a typed refusal. No I/O: the driver reads the frame,
//! passes `now`, and writes whatever this returns.
//!
//! Also here: the connection's authentication deadline ([`AuthDeadline`]), which closes
//! a connection that has authenticated no stream in time.

use std::rc::Rc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use felix_core_runtime::clock::Now;
use felix_wire::flags::FrameKind;
use felix_wire::{Features, Flags, Frame, Message};

use crate::auth::{Action, Grant, TenantKeys};
use crate::catalog::validate_name;
use crate::error::BrokerError;
use crate::session::SERVER_FLAGS;

/// What a stream negotiated in its handshake.
#[derive(Debug, Clone)]
pub struct Session {
    grant: Rc<Grant>,
    /// The bearer token, for requests forwarded to another broker.
    pub token: Rc<str>,
    /// Layouts both sides read: what we may send.
    pub flags: Flags,
    /// Features the client offered that we serve.
    pub features: Features,
    /// How many times its requests were forwarded to get here: 1 on a broker's
    /// connection forwarding its clients' requests ([`felix_wire::internal::FORWARD_ALPN`]),
    /// 2 on one forwarding requests forwarded to that broker
    /// ([`felix_wire::internal::FORWARD_AGAIN_ALPN`]), which are not forwarded again.
    pub forwarded: u8,
}

impl Session {
    /// A session for `grant` (tests and the fuzz target build these directly).
    pub fn new(grant: Grant, token: &str, flags: Flags, features: Features) -> Session {
        Session {
            grant: Rc::new(grant),
            token: token.into(),
            flags: flags.intersection(SERVER_FLAGS),
            features,
            forwarded: 0,
        }
    }

    /// The authenticated tenant.
    pub fn tenant(&self) -> &str {
        &self.grant.tenant
    }

    /// What the token granted (and which key verified it).
    pub fn grant(&self) -> &Rc<Grant> {
        &self.grant
    }

    /// Holds `kept`, the connection's grant for the same token, instead of its own: the
    /// connection counts a grant's holders to tell a token no stream uses any more.
    pub fn hold_grant(&mut self, kept: Rc<Grant>) {
        debug_assert!(kept.revoked_with(&self.grant));
        self.grant = kept;
    }

    /// Whether the client reads coded errors.
    pub fn coded(&self) -> bool {
        self.features.contains(Features::ERROR_CODES)
    }

    /// Refuses a request naming another tenant than the token's.
    pub fn check_tenant(&self, tenant: &str) -> Result<(), BrokerError> {
        if tenant != self.grant.tenant {
            return Err(BrokerError::Forbidden(format!(
                "authenticated as tenant {:?}, request names tenant {:?}",
                self.grant.tenant,
                crate::error::cut(tenant)
            )));
        }
        Ok(())
    }

    /// Refuses a question about `tenant/ns/name` (whether it exists, how it is split,
    /// who leads it) from a token that may do nothing with it: the answer is the
    /// name's, as a read's is. Any permission on the name will do (a
    /// publisher asks for its stream's shards too).
    pub fn check_visible(
        &self,
        cache: bool,
        tenant: &str,
        ns: &str,
        name: &str,
        now: Now,
    ) -> Result<(), BrokerError> {
        let actions = if cache {
            [Action::CacheRead, Action::CacheWrite]
        } else {
            [Action::StreamSubscribe, Action::StreamPublish]
        };
        let mut refused = None;
        for a in actions {
            match self.authorize(a, tenant, ns, name, now) {
                Ok(()) => return Ok(()),
                Err(e) => refused = refused.or(Some(e)),
            }
        }
        Err(refused.expect("two actions were checked"))
    }

    /// Checks `action` on `tenant/ns/name`: the tenant, the names' syntax, then the
    /// permission (the token's expiry was checked when the stream opened).
    pub fn authorize(
        &self,
        action: Action,
        tenant: &str,
        ns: &str,
        name: &str,
        now: Now,
    ) -> Result<(), BrokerError> {
        let kind = if matches!(action, Action::CacheRead | Action::CacheWrite) {
            "cache"
        } else {
            "stream"
        };
        self.check_names(tenant, ns, (kind, name), now)?;
        if !self.grant.allows(action, ns, name) {
            return Err(BrokerError::Forbidden(format!(
                "token lacks {action:?} on {tenant}/{ns}/{name}"
            )));
        }
        Ok(())
    }

    /// The checks every request takes before its permission: the tenant, the names'
    /// syntax (`name` of `kind`). Not the token's expiry: as the protocol has it, a
    /// token is checked when its stream opens and an open stream outlives it (the SDK
    /// asks its token provider only when a stream authenticates, so a long-lived
    /// publisher refused `unauthenticated` mid-stream, a fatal answer, stopped for
    /// good); a revoked token or retired key still closes the connection, and a
    /// forward opens a stream at the leader with the token, checked there.
    fn check_names(
        &self,
        tenant: &str,
        ns: &str,
        (kind, name): (&'static str, &str),
        _now: Now,
    ) -> Result<(), BrokerError> {
        self.check_tenant(tenant)?;
        validate_name("namespace", ns)?;
        validate_name(kind, name)
    }

    /// Checks that this token may act on group `group` of `tenant/ns/stream`: as
    /// [`Session::authorize`], the permission being, to `manage` it (redrive, discard,
    /// delete, move its cursor), `group.manage` on the group or `stream.manage` on the
    /// stream, and otherwise, to consume through it (poll, ack, nack, extend,
    /// dead-letter, list, describe), `group.consume` on it or `stream.subscribe` on the
    /// stream.
    pub fn authorize_group(
        &self,
        manage: bool,
        (tenant, ns, stream, group): (&str, &str, &str, &str),
        now: Now,
    ) -> Result<(), BrokerError> {
        self.check_names(tenant, ns, ("stream", stream), now)?;
        let (allowed, wanted, implied_by) = if manage {
            let allowed = self.grant.allows_group_manage(ns, stream, group);
            (allowed, "group.manage", "stream.manage")
        } else {
            let allowed = self.grant.allows_group_consume(ns, stream, group);
            (allowed, "group.consume", "stream.subscribe")
        };
        if !allowed {
            return Err(BrokerError::Forbidden(format!(
                "token lacks {wanted} on {tenant}/{ns}/{stream}/{group} \
                 (or {implied_by} on the stream)"
            )));
        }
        Ok(())
    }

    /// Whether this token may write `ns/name`, which is what creating it on first use
    /// (dev mode) requires: a stream needs publish, a cache needs write.
    pub fn may_create(&self, stream: bool, ns: &str, name: &str) -> bool {
        let action = if stream {
            Action::StreamPublish
        } else {
            Action::CacheWrite
        };
        self.grant.allows(action, ns, name)
    }
}

/// What the handshake needs to know about the broker.
#[derive(Debug, Clone, Copy)]
pub struct HandshakeEnv<'a> {
    /// Token verification keys.
    pub keys: &'a TenantKeys,
    /// Features this broker serves.
    pub served: Features,
    /// The broker is shutting down.
    pub draining: bool,
    /// The broker serves, but has not finished starting: a clustered broker answers on
    /// its port before its first sync with the control plane brings the tenants' keys.
    pub starting: bool,
    /// Acked publishes a stream may have unanswered.
    pub publish_window: u32,
}

/// Why a stream was not authenticated, and what to tell the client before ending it.
#[derive(Debug)]
pub struct Refusal {
    /// The frame to send (None: the client gets no answer, only the end of the stream).
    pub answer: Option<Bytes>,
    /// Why.
    pub error: BrokerError,
}

impl Refusal {
    fn new(error: BrokerError, coded: bool) -> Refusal {
        Refusal {
            answer: Some(error.to_message(coded).to_frame()),
            error,
        }
    }
}

/// Checks a stream's first frame at `now`: on success the session and the `auth_ok`
/// (or legacy `ok`) frame; otherwise the refusal.
pub fn handshake(
    frame: &Frame,
    env: &HandshakeEnv<'_>,
    now: Now,
) -> Result<(Session, Bytes), Refusal> {
    if frame.kind != FrameKind::Json {
        return Err(Refusal::new(
            BrokerError::Unauthenticated("auth required before any other frame".into()),
            false,
        ));
    }
    let Ok(Message::Auth {
        tenant_id,
        token,
        client_flags,
        client_features,
        client_features_hi,
    }) = Message::decode(&frame.payload)
    else {
        return Err(Refusal::new(
            BrokerError::Unauthenticated("the first message must be auth".into()),
            false,
        ));
    };
    let offered = Features::from_wire(client_features, client_features_hi);
    let coded = offered.contains(Features::ERROR_CODES);
    if env.draining {
        // Only a client that reads codes can tell `draining` from a refusal.
        return Err(if coded {
            Refusal::new(BrokerError::Draining, true)
        } else {
            Refusal {
                answer: None,
                error: BrokerError::Draining,
            }
        });
    }
    if env.starting {
        // Every tenant would look unknown until the keys arrive, and `unauthenticated`
        // is fatal to a client: this is a retry.
        return Err(Refusal::new(
            BrokerError::ShardUnavailable("not_ready".into()),
            coded,
        ));
    }
    let grant = env
        .keys
        .verify(&token, &tenant_id, now.wall_secs())
        .map_err(|e| Refusal::new(BrokerError::Unauthenticated(e.to_string()), coded))?;
    let legacy = client_flags.is_none();
    let client_flags = client_flags.map_or(Flags::ORIGINAL_V1, Flags);
    let features = offered.intersection(env.served);
    let reply = if legacy {
        Message::Ok
    } else {
        let (lo, hi) = env.served.answer(offered);
        Message::AuthOk {
            server_flags: SERVER_FLAGS.bits(),
            server_features: lo,
            server_features_hi: hi,
            listener_ports: None,
            publish_window: features
                .contains(Features::PUBLISH_PIPELINE)
                .then_some(env.publish_window),
        }
    };
    Ok((
        Session::new(grant, &token, client_flags, features),
        reply.to_frame(),
    ))
}

/// A connection's authentication deadline: until one of its streams authenticates, the
/// connection is closed at `accepted + timeout` (QUIC application error 1). `None`
/// timeout: never (some older SDKs keep idle pooled connections unauthenticated).
#[derive(Debug, Clone, Copy)]
pub struct AuthDeadline {
    deadline: Option<Instant>,
}

/// What the deadline asks of the connection now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthTimer {
    /// Authenticated, or no deadline: nothing to do.
    Done,
    /// Check again at this instant.
    WaitUntil(Instant),
    /// Close the connection.
    Expired,
}

impl AuthDeadline {
    /// The deadline of a connection accepted at `accepted`.
    pub fn new(accepted: Instant, timeout: Option<Duration>) -> AuthDeadline {
        AuthDeadline {
            deadline: timeout.map(|t| accepted + t),
        }
    }

    /// A stream authenticated: the deadline no longer applies.
    pub fn authenticated(&mut self) {
        self.deadline = None;
    }

    /// What to do at `now`.
    pub fn poll(&self, now: Instant) -> AuthTimer {
        match self.deadline {
            None => AuthTimer::Done,
            Some(d) if now >= d => AuthTimer::Expired,
            Some(d) => AuthTimer::WaitUntil(d),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::{Claims, SigningKey, all_data_perms};
    use crate::session::SERVER_FEATURES;

    pub(crate) fn keys_and_token(now_secs: u64, exp: u64) -> (TenantKeys, String) {
        let key = SigningKey::generate("k1").unwrap();
        let mut keys = TenantKeys::default();
        keys.add("t1", "k1", key.public_key());
        let token = key.sign(&Claims {
            iss: crate::auth::ISSUER.into(),
            aud: crate::auth::BROKER_AUDIENCE.into(),
            sub: "tester".into(),
            tid: "t1".into(),
            iat: now_secs,
            exp,
            nbf: None,
            perms: all_data_perms("t1"),
            jti: None,
        });
        (keys, token)
    }

    fn auth_frame(tenant: &str, token: &str, features: Features) -> Frame {
        let (lo, hi) = features.offer();
        let bytes = Message::Auth {
            tenant_id: tenant.into(),
            token: token.into(),
            client_flags: Some(0x1fff),
            client_features: lo,
            client_features_hi: hi,
        }
        .to_frame();
        crate::session::testing::parse_frame(&bytes)
    }

    fn now(secs: u64) -> Now {
        Now::at(Instant::now(), secs * 1_000_000)
    }

    fn env(keys: &TenantKeys) -> HandshakeEnv<'_> {
        HandshakeEnv {
            keys,
            served: SERVER_FEATURES,
            draining: false,
            starting: false,
            publish_window: 256,
        }
    }

    #[test]
    fn a_valid_token_yields_a_session_with_the_features_both_sides_have() {
        let (keys, token) = keys_and_token(1000, 5000);
        // Publisher names on group records are a feature this broker does not serve;
        // named group members it does.
        let offered = Features::ERROR_CODES
            .union(Features::GROUP_PUBLISHER)
            .union(Features::GROUP_CONSUMER);
        let (session, reply) =
            handshake(&auth_frame("t1", &token, offered), &env(&keys), now(1000)).unwrap();
        assert_eq!(session.tenant(), "t1");
        assert!(session.coded());
        assert!(
            !session.features.contains(Features::GROUP_PUBLISHER),
            "a feature we do not serve is not granted"
        );
        assert!(session.features.contains(Features::GROUP_CONSUMER));
        let reply = Message::decode(&reply[12..]).unwrap();
        assert!(matches!(reply, Message::AuthOk { .. }), "{reply:?}");
    }

    #[test]
    fn refusals_are_typed_and_coded_only_for_clients_that_read_codes() {
        let (keys, token) = keys_and_token(1000, 5000);
        let e = env(&keys);
        let r = handshake(
            &auth_frame("t1", "garbage", Features::ERROR_CODES),
            &e,
            now(1000),
        )
        .unwrap_err();
        assert!(matches!(r.error, BrokerError::Unauthenticated(_)));
        let m = Message::decode(&r.answer.unwrap()[12..]).unwrap();
        assert!(
            matches!(
                m,
                Message::Error {
                    code: Some(felix_wire::ErrorCode::Unauthenticated),
                    ..
                }
            ),
            "{m:?}"
        );
        // Another tenant's name with this token.
        let r = handshake(&auth_frame("t2", &token, Features(0)), &e, now(1000)).unwrap_err();
        assert!(matches!(r.error, BrokerError::Unauthenticated(_)));
        // Draining: an uncoded client gets no answer at all.
        let draining = HandshakeEnv {
            draining: true,
            ..e
        };
        let r =
            handshake(&auth_frame("t1", &token, Features(0)), &draining, now(1000)).unwrap_err();
        assert!(r.answer.is_none());
        let r = handshake(
            &auth_frame("t1", &token, Features::ERROR_CODES),
            &draining,
            now(1000),
        )
        .unwrap_err();
        assert!(matches!(r.error, BrokerError::Draining) && r.answer.is_some());
        // Still starting (keys not yet synced): a retry, never `unauthenticated`.
        let starting = HandshakeEnv {
            starting: true,
            ..e
        };
        let r = handshake(
            &auth_frame("t1", &token, Features::ERROR_CODES),
            &starting,
            now(1000),
        )
        .unwrap_err();
        assert!(
            matches!(&r.error, BrokerError::ShardUnavailable(why) if why == "not_ready"),
            "{:?}",
            r.error
        );
        // A binary frame first.
        let bin = Frame {
            flags: Flags::BINARY_PUBLISH_BATCH,
            kind: FrameKind::PublishBatch,
            payload: Bytes::new(),
        };
        assert!(matches!(
            handshake(&bin, &e, now(1000)).unwrap_err().error,
            BrokerError::Unauthenticated(_)
        ));
    }

    /// A session on a token that never expires serves requests (adding the leeway to
    /// its expiry overflowed once: a panic in a debug build, refused in a release one).
    #[test]
    fn a_token_expiring_at_the_end_of_time_serves() {
        let (keys, token) = keys_and_token(1000, u64::MAX);
        let e = env(&keys);
        let (session, _) =
            handshake(&auth_frame("t1", &token, Features(0)), &e, now(1500)).unwrap();
        session
            .authorize(Action::StreamPublish, "t1", "default", "s", now(1999))
            .expect("it holds");
    }

    /// A token is checked when its stream opens, and an open stream outlives it, as the
    /// protocol has it: refused per request, a long-lived SDK publisher (whose token
    /// provider is asked only when a stream authenticates) stopped at its token's
    /// expiry.
    #[test]
    fn an_expired_token_is_refused_at_the_handshake_and_an_open_stream_outlives_it() {
        let (keys, token) = keys_and_token(1000, 2000);
        let e = env(&keys);
        assert!(handshake(&auth_frame("t1", &token, Features(0)), &e, now(2000 + 3600)).is_err());
        let (session, _) =
            handshake(&auth_frame("t1", &token, Features(0)), &e, now(1500)).unwrap();
        assert!(
            session
                .authorize(Action::StreamPublish, "t1", "default", "s", now(1999))
                .is_ok()
        );
        assert!(
            session
                .authorize(
                    Action::StreamPublish,
                    "t1",
                    "default",
                    "s",
                    now(2000 + 3600)
                )
                .is_ok(),
            "a stream outlives its token"
        );
    }

    #[test]
    fn the_auth_deadline_fires_only_while_unauthenticated() {
        let t0 = Instant::now();
        let mut d = AuthDeadline::new(t0, Some(Duration::from_secs(10)));
        assert_eq!(
            d.poll(t0),
            AuthTimer::WaitUntil(t0 + Duration::from_secs(10))
        );
        assert_eq!(d.poll(t0 + Duration::from_secs(10)), AuthTimer::Expired);
        d.authenticated();
        assert_eq!(d.poll(t0 + Duration::from_secs(11)), AuthTimer::Done);
        let off = AuthDeadline::new(t0, None);
        assert_eq!(off.poll(t0 + Duration::from_secs(3600)), AuthTimer::Done);
    }
}
