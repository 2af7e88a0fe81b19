//! Felix tokens: EdDSA (Ed25519) JWTs with `perms`, verified against the tenant's keys
//! (feature `tokens`). Shared by the broker (verifying client tokens), the control plane
//! (issuing them and verifying its own) and tools. Pure: no I/O, no clock (callers pass
//! `now`).
//!
//! Claims checked: signature by one of the tenant's keys (`kid` selects it when
//! present), `iss = felix-auth`, `aud = felix-broker`, `exp`/`nbf` with 60 s skew, and
//! `tid` equal to the tenant the client authenticates as. `perms` are `action:object`
//! strings, parsed once per stream and matched per operation, with `*` matching one path
//! segment (`stream:acme/*/*`). `tenant.manage:tenant:T` grants every data action in `T`,
//! `ns.manage:namespace:T/N` every data action in that namespace.

use std::collections::HashMap;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ring::signature::{self, Ed25519KeyPair, KeyPair};
use serde::{Deserialize, Serialize};

/// The audience brokers accept.
pub const BROKER_AUDIENCE: &str = "felix-broker";
/// The audience the control plane accepts.
pub const CONTROLPLANE_AUDIENCE: &str = "felix-controlplane";
/// The issuer of Felix tokens.
pub const ISSUER: &str = "felix-auth";
/// Clock skew a token's times are allowed (seconds): it verifies up to this long past
/// its `exp`.
pub const SKEW_SECS: u64 = 60;

/// Why a token is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// Not three base64url parts, or bad JSON.
    #[error("malformed token: {0}")]
    Malformed(&'static str),
    /// Revoked by id.
    #[error("{0}")]
    Revoked(String),
    /// Not EdDSA.
    #[error("unsupported token algorithm {0:?} (expected EdDSA)")]
    Algorithm(String),
    /// No key of this tenant verifies it.
    #[error("token signature does not verify for tenant {0}")]
    Signature(String),
    /// Wrong `iss`/`aud`.
    #[error("token {claim} is {found:?}, expected {expected:?}")]
    Claim {
        /// The claim.
        claim: &'static str,
        /// Its value.
        found: String,
        /// What we accept.
        expected: &'static str,
    },
    /// Past `exp` or before `nbf`.
    #[error("token expired or not yet valid")]
    Expired,
    /// `tid` differs from the tenant authenticated as.
    #[error("token is for tenant {token:?}, not {requested:?}")]
    WrongTenant {
        /// From the token.
        token: String,
        /// From `auth.tenant_id`.
        requested: String,
    },
    /// The tenant has no keys here.
    #[error("unknown tenant {0:?}")]
    UnknownTenant(String),
    /// A permission string that does not parse.
    #[error("malformed permission {0:?}")]
    Permission(String),
}

#[derive(Debug, Serialize, Deserialize)]
struct Header {
    alg: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    typ: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    kid: Option<String>,
}

/// Token claims.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Claims {
    /// Issuer.
    pub iss: String,
    /// Audience.
    pub aud: String,
    /// Principal.
    pub sub: String,
    /// Tenant.
    pub tid: String,
    /// Issued at (s).
    pub iat: u64,
    /// Expires at (s).
    pub exp: u64,
    /// Not before (s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbf: Option<u64>,
    /// `action:object` permissions.
    #[serde(default)]
    pub perms: Vec<String>,
    /// Token id: what a deny-list names to revoke this one token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jti: Option<String>,
}

/// A signing key (dev mode and tests; production keys live in the control plane).
pub struct SigningKey {
    pair: Ed25519KeyPair,
    pkcs8: Vec<u8>,
    /// Key id put in token headers.
    pub kid: String,
}

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningKey")
            .field("kid", &self.kid)
            .finish()
    }
}

impl SigningKey {
    /// A fresh key.
    pub fn generate(kid: &str) -> Result<SigningKey, AuthError> {
        let rng = ring::rand::SystemRandom::new();
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&rng)
            .map_err(|_| AuthError::Malformed("could not generate an Ed25519 key"))?;
        Self::from_pkcs8(pkcs8.as_ref(), kid)
    }

    /// Loads a PKCS#8 key.
    pub fn from_pkcs8(pkcs8: &[u8], kid: &str) -> Result<SigningKey, AuthError> {
        let pair = Ed25519KeyPair::from_pkcs8(pkcs8)
            .map_err(|_| AuthError::Malformed("not an Ed25519 PKCS#8 key"))?;
        Ok(SigningKey {
            pair,
            pkcs8: pkcs8.to_vec(),
            kid: kid.to_owned(),
        })
    }

    /// The PKCS#8 bytes.
    pub fn pkcs8(&self) -> &[u8] {
        &self.pkcs8
    }

    /// The raw 32-byte public key.
    pub fn public_key(&self) -> Vec<u8> {
        self.pair.public_key().as_ref().to_vec()
    }

    /// Signs claims into a JWT.
    pub fn sign(&self, claims: &Claims) -> String {
        let header = Header {
            alg: "EdDSA".into(),
            typ: Some("JWT".into()),
            kid: Some(self.kid.clone()),
        };
        let h = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&header).expect("header serializes"));
        let c = URL_SAFE_NO_PAD.encode(serde_json::to_vec(claims).expect("claims serialize"));
        let input = format!("{h}.{c}");
        let sig = self.pair.sign(input.as_bytes());
        format!("{input}.{}", URL_SAFE_NO_PAD.encode(sig.as_ref()))
    }
}

/// Every tenant's verification keys: tenant -> (kid, raw Ed25519 public key), and the
/// tokens revoked by id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenantKeys {
    keys: HashMap<String, Vec<(String, Vec<u8>)>>,
    /// (tenant, jti) of revoked tokens.
    denied: std::collections::HashSet<(String, String)>,
}

impl TenantKeys {
    /// Adds a key for `tenant`.
    pub fn add(&mut self, tenant: &str, kid: &str, public_key: Vec<u8>) {
        self.keys
            .entry(tenant.to_owned())
            .or_default()
            .push((kid.to_owned(), public_key));
    }

    /// Revokes `tenant`'s token `jti`.
    pub fn deny(&mut self, tenant: &str, jti: &str) {
        self.denied.insert((tenant.to_owned(), jti.to_owned()));
    }

    /// `tenant`'s keys, in the order added.
    pub fn keys_of(&self, tenant: &str) -> &[(String, Vec<u8>)] {
        self.keys.get(tenant).map_or(&[], Vec::as_slice)
    }

    /// Replaces `tenant`'s keys.
    pub fn set_keys(&mut self, tenant: &str, keys: Vec<(String, Vec<u8>)>) {
        self.keys.insert(tenant.to_owned(), keys);
    }

    /// Why a grant verified earlier no longer holds: its key was retired, or its token
    /// revoked. `None` while it holds (expiry is checked when a stream opens, not here).
    pub fn revoked(&self, grant: &Grant) -> Option<String> {
        if !self.has_key(&grant.tenant, &grant.kid) {
            return Some(format!("signing key {} retired", grant.kid));
        }
        match &grant.jti {
            Some(jti) if self.denied.contains(&(grant.tenant.clone(), jti.clone())) => {
                Some(format!("token {jti} revoked"))
            }
            _ => None,
        }
    }

    /// Verifies a broker-audience `token` for `tenant` at `now` (seconds) and compiles
    /// its permissions.
    pub fn verify(&self, token: &str, tenant: &str, now: u64) -> Result<Grant, AuthError> {
        self.verify_for(token, tenant, now, BROKER_AUDIENCE)
    }

    /// The tenant a token claims (unverified: only to pick the keys to verify with).
    pub fn claimed_tenant(token: &str) -> Option<String> {
        let claims = token.trim().split('.').nth(1)?;
        let bytes = URL_SAFE_NO_PAD.decode(claims).ok()?;
        serde_json::from_slice::<serde_json::Value>(&bytes)
            .ok()?
            .get("tid")?
            .as_str()
            .map(str::to_owned)
    }

    /// Tenants with keys.
    pub fn tenants(&self) -> impl Iterator<Item = &str> {
        self.keys.keys().map(String::as_str)
    }

    /// Verifies `token` for `tenant` and `audience`.
    pub fn verify_for(
        &self,
        token: &str,
        tenant: &str,
        now: u64,
        audience: &'static str,
    ) -> Result<Grant, AuthError> {
        let mut parts = token.trim().split('.');
        let (Some(h), Some(c), Some(s), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(AuthError::Malformed("expected three dot-separated parts"));
        };
        let decode = |p: &str| {
            URL_SAFE_NO_PAD
                .decode(p)
                .map_err(|_| AuthError::Malformed("bad base64url"))
        };
        let header: Header = serde_json::from_slice(&decode(h)?)
            .map_err(|_| AuthError::Malformed("bad header JSON"))?;
        if header.alg != "EdDSA" {
            return Err(AuthError::Algorithm(header.alg));
        }
        let keys = self
            .keys
            .get(tenant)
            .ok_or_else(|| AuthError::UnknownTenant(tenant.to_owned()))?;
        let sig = decode(s)?;
        let input = &token.trim()[..h.len() + 1 + c.len()];
        let Some((kid, _)) = keys
            .iter()
            .filter(|(kid, _)| header.kid.as_ref().is_none_or(|k| k == kid))
            .find(|(_, pk)| {
                signature::UnparsedPublicKey::new(&signature::ED25519, pk)
                    .verify(input.as_bytes(), &sig)
                    .is_ok()
            })
        else {
            return Err(AuthError::Signature(tenant.to_owned()));
        };
        let claims: Claims = serde_json::from_slice(&decode(c)?)
            .map_err(|_| AuthError::Malformed("bad claims JSON"))?;
        if claims.iss != ISSUER {
            return Err(AuthError::Claim {
                claim: "iss",
                found: claims.iss,
                expected: ISSUER,
            });
        }
        if claims.aud != audience {
            return Err(AuthError::Claim {
                claim: "aud",
                found: claims.aud,
                expected: audience,
            });
        }
        if now > claims.exp.saturating_add(SKEW_SECS)
            || claims
                .nbf
                .is_some_and(|nbf| now.saturating_add(SKEW_SECS) < nbf)
        {
            return Err(AuthError::Expired);
        }
        if claims.tid != tenant {
            return Err(AuthError::WrongTenant {
                token: claims.tid,
                requested: tenant.to_owned(),
            });
        }
        let mut grant = Grant::compile(&claims)?;
        grant.kid = kid.clone();
        if let Some(why) = self.revoked(&grant) {
            return Err(AuthError::Revoked(why));
        }
        Ok(grant)
    }

    /// Whether `kid` is still one of `tenant`'s keys.
    pub fn has_key(&self, tenant: &str, kid: &str) -> bool {
        self.keys
            .get(tenant)
            .is_some_and(|ks| ks.iter().any(|(k, _)| k == kid))
    }
}

/// A JWKS document's key (`{kty: OKP, crv: Ed25519, kid, alg: EdDSA, use: sig, x}`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Jwk {
    /// `OKP`.
    pub kty: String,
    /// Key id.
    pub kid: String,
    /// `EdDSA`.
    pub alg: String,
    /// `sig`.
    #[serde(rename = "use")]
    pub use_: String,
    /// `Ed25519`.
    pub crv: String,
    /// The public key, base64url.
    pub x: String,
}

impl Jwk {
    /// The JWK of a raw Ed25519 public key.
    pub fn ed25519(kid: &str, public_key: &[u8]) -> Jwk {
        Jwk {
            kty: "OKP".into(),
            kid: kid.into(),
            alg: "EdDSA".into(),
            use_: "sig".into(),
            crv: "Ed25519".into(),
            x: URL_SAFE_NO_PAD.encode(public_key),
        }
    }

    /// The raw public key, when this is an Ed25519 key.
    pub fn public_key(&self) -> Option<Vec<u8>> {
        if self.kty != "OKP" || self.crv != "Ed25519" {
            return None;
        }
        URL_SAFE_NO_PAD
            .decode(&self.x)
            .ok()
            .filter(|k| k.len() == 32)
    }
}

/// A data-path action a broker checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Publish to a stream.
    StreamPublish,
    /// Subscribe to (or read) a stream.
    StreamSubscribe,
    /// Read a cache.
    CacheRead,
    /// Write a cache.
    CacheWrite,
}

impl Action {
    fn name(self) -> &'static str {
        match self {
            Action::StreamPublish => "stream.publish",
            Action::StreamSubscribe => "stream.subscribe",
            Action::CacheRead => "cache.read",
            Action::CacheWrite => "cache.write",
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Action::StreamPublish | Action::StreamSubscribe => "stream",
            Action::CacheRead | Action::CacheWrite => "cache",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Perm {
    action: String,
    kind: String,
    path: Vec<String>,
}

/// What a verified token allows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The tenant.
    pub tenant: String,
    /// The principal.
    pub principal: String,
    /// Expiry (s).
    pub expires_at: u64,
    /// The id of the key that verified the token.
    pub kid: String,
    /// The token's id, when it has one.
    pub jti: Option<String>,
    perms: Vec<Perm>,
}

impl Grant {
    /// Whether every revocation that hits `other` hits this grant too, and the other way
    /// round ([`TenantKeys::revoked`]: its tenant's signing key retired, or its token id
    /// denied): the same tenant, key and token id. Grants alike share what a revocation
    /// ends (a connection they authenticated).
    pub fn revoked_with(&self, other: &Grant) -> bool {
        self.tenant == other.tenant && self.kid == other.kid && self.jti == other.jti
    }

    fn compile(claims: &Claims) -> Result<Grant, AuthError> {
        let mut perms = Vec::with_capacity(claims.perms.len());
        for p in &claims.perms {
            let bad = || AuthError::Permission(p.clone());
            let (action, object) = p.split_once(':').ok_or_else(bad)?;
            let (kind, path) = object.split_once(':').ok_or_else(bad)?;
            perms.push(Perm {
                action: action.to_owned(),
                kind: kind.to_owned(),
                path: path.split('/').map(str::to_owned).collect(),
            });
        }
        Ok(Grant {
            tenant: claims.tid.clone(),
            principal: claims.sub.clone(),
            expires_at: claims.exp,
            kid: String::new(),
            jti: claims.jti.clone(),
            perms,
        })
    }

    /// Whether `action` is allowed on `namespace/name` in this grant's tenant.
    pub fn allows(&self, action: Action, namespace: &str, name: &str) -> bool {
        let want = [self.tenant.as_str(), namespace, name];
        let seg = |pat: &str, v: &str| pat == "*" || pat == v;
        self.perms
            .iter()
            .any(|p| match (p.action.as_str(), p.kind.as_str()) {
                ("tenant.manage", "tenant") => p.path.len() == 1 && p.path[0] == self.tenant,
                ("ns.manage", "namespace") => {
                    p.path.len() == 2 && p.path[0] == self.tenant && seg(&p.path[1], namespace)
                }
                (a, k) if a == action.name() && k == action.kind() => {
                    p.path.len() == 3
                        && p.path[0] == self.tenant
                        && seg(&p.path[1], want[1])
                        && seg(&p.path[2], want[2])
                }
                _ => false,
            })
    }
}

impl Grant {
    /// Whether the grant may manage group `group` of `namespace/stream` (redrive and
    /// discard its dead letters), as the reference has it: `group.manage` on
    /// `group:T/N/S/G` (`*` matching one segment), or `stream.manage` on the stream,
    /// which implies it; `tenant.manage` and `ns.manage` as for every action inside them.
    pub fn allows_group_manage(&self, namespace: &str, stream: &str, group: &str) -> bool {
        self.perms
            .iter()
            .any(|p| match (p.action.as_str(), p.kind.as_str()) {
                ("tenant.manage", "tenant") => self.within(p, &[]),
                ("ns.manage", "namespace") => self.within(p, &[namespace]),
                ("stream.manage", "stream") => self.within(p, &[namespace, stream]),
                ("group.manage", "group") => self.within(p, &[namespace, stream, group]),
                _ => false,
            })
    }

    /// Whether the grant may consume through group `group` of `namespace/stream` (poll,
    /// ack, nack, extend, dead-letter, list its dead letters, describe it), as the
    /// reference has it: `group.consume` on `group:T/N/S/G`, or `stream.subscribe` on
    /// the stream, which implies it (and what implies that).
    pub fn allows_group_consume(&self, namespace: &str, stream: &str, group: &str) -> bool {
        self.allows(Action::StreamSubscribe, namespace, stream)
            || self.perms.iter().any(|p| {
                (p.action.as_str(), p.kind.as_str()) == ("group.consume", "group")
                    && self.within(p, &[namespace, stream, group])
            })
    }

    /// Whether `p`'s path is this grant's tenant then `names`, `*` matching one segment.
    fn within(&self, p: &Perm, names: &[&str]) -> bool {
        p.path.len() == names.len() + 1
            && p.path[0] == self.tenant
            && p.path[1..]
                .iter()
                .zip(names)
                .all(|(pat, v)| pat == "*" || pat == v)
    }

    /// Whether the grant holds `action` on `kind:path` (e.g. `stream.manage` on
    /// `stream:acme/default/orders`), with `*` matching one segment, and the
    /// implications: `tenant.manage:tenant:T` covers every `*.manage`, read and write
    /// action inside `T`; `ns.manage:namespace:T/N` those inside `T/N`; a `cluster:*`
    /// grant covers the same action on every object. Objects inside a tenant are
    /// allowed only inside the grant's own tenant, whatever a permission's path says,
    /// except through `cluster` permissions (the operator's).
    pub fn allows_object(&self, action: &str, kind: &str, path: &[&str]) -> bool {
        let seg = |pat: &str, v: &str| pat == "*" || pat == v;
        let inside_tenant = matches!(kind, "tenant" | "namespace" | "stream" | "cache" | "group");
        let own_tenant = path.first() == Some(&self.tenant.as_str());
        self.perms.iter().any(|p| {
            if p.kind == "cluster" && p.action == action {
                return true;
            }
            if p.kind == "cluster" && p.action == "tenant.manage" && inside_tenant {
                return true;
            }
            if inside_tenant && !own_tenant {
                return false;
            }
            match (p.action.as_str(), p.kind.as_str()) {
                ("tenant.manage", "tenant") if inside_tenant => {
                    p.path.len() == 1 && path.first().is_some_and(|t| seg(&p.path[0], t))
                }
                ("ns.manage", "namespace")
                    if matches!(kind, "namespace" | "stream" | "cache" | "group") =>
                {
                    p.path.len() == 2
                        && path.len() >= 2
                        && seg(&p.path[0], path[0])
                        && seg(&p.path[1], path[1])
                }
                (a, k) if a == action && k == kind => {
                    p.path.len() == path.len()
                        && p.path.iter().zip(path).all(|(pat, v)| seg(pat, v))
                }
                _ => false,
            }
        })
    }

    /// The `perms` strings.
    pub fn perm_strings(&self) -> Vec<String> {
        self.perms
            .iter()
            .map(|p| format!("{}:{}:{}", p.action, p.kind, p.path.join("/")))
            .collect()
    }
}

/// The permissions a dev-mode admin token carries: every data action in the tenant.
pub fn all_data_perms(tenant: &str) -> Vec<String> {
    vec![
        format!("stream.publish:stream:{tenant}/*/*"),
        format!("stream.subscribe:stream:{tenant}/*/*"),
        format!("stream.manage:stream:{tenant}/*/*"),
        format!("cache.read:cache:{tenant}/*/*"),
        format!("cache.write:cache:{tenant}/*/*"),
        format!("cache.manage:cache:{tenant}/*/*"),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims(tid: &str, perms: Vec<String>) -> Claims {
        Claims {
            iss: ISSUER.into(),
            aud: BROKER_AUDIENCE.into(),
            sub: "alice".into(),
            tid: tid.into(),
            iat: 1000,
            exp: 2000,
            nbf: None,
            perms,
            jti: None,
        }
    }

    fn setup() -> (SigningKey, TenantKeys) {
        let key = SigningKey::generate("k1").unwrap();
        let mut keys = TenantKeys::default();
        keys.add("acme", "k1", key.public_key());
        (key, keys)
    }

    /// A grant of tenant `acme` holding `perms`, as a verified token gives it.
    fn grant(perms: &[&str]) -> Grant {
        let (key, keys) = setup();
        let t = key.sign(&claims(
            "acme",
            perms.iter().map(|p| p.to_string()).collect(),
        ));
        keys.verify(&t, "acme", 1500).unwrap()
    }

    #[test]
    fn a_grant_stops_holding_when_its_key_is_retired_or_its_token_denied() {
        let (key, mut keys) = setup();
        let other = SigningKey::generate("k2").unwrap();
        keys.add("acme", "k2", other.public_key());
        let mut c = claims("acme", vec![]);
        c.jti = Some("t-1".into());
        let g = keys.verify(&key.sign(&c), "acme", 1500).unwrap();
        assert_eq!(g.kid, "k1", "the key that verified it is recorded");
        assert_eq!(g.jti.as_deref(), Some("t-1"));
        assert_eq!(keys.revoked(&g), None);
        // Denied by id: the grant no longer holds, and the token no longer verifies.
        let mut denied = keys.clone();
        denied.deny("acme", "t-1");
        assert!(denied.revoked(&g).unwrap().contains("t-1"));
        assert!(matches!(
            denied.verify(&key.sign(&c), "acme", 1500),
            Err(AuthError::Revoked(_))
        ));
        // Another tenant's denial of the same id does nothing here.
        let mut elsewhere = keys.clone();
        elsewhere.deny("globex", "t-1");
        assert_eq!(elsewhere.revoked(&g), None);
        // k1 retired: the grant is gone; k2's tokens still hold.
        let mut rotated = TenantKeys::default();
        rotated.add("acme", "k2", other.public_key());
        assert!(rotated.revoked(&g).unwrap().contains("k1"));
        let g2 = rotated.verify(&other.sign(&c), "acme", 1500).unwrap();
        assert_eq!(rotated.revoked(&g2), None);
        assert!(rotated.verify(&key.sign(&c), "acme", 1500).is_err());
    }

    /// A permission naming another tenant (or every tenant) allows nothing outside the
    /// grant's own tenant: the control plane mints none, and this holds should one
    /// ever be signed.
    #[test]
    fn object_permissions_reach_no_further_than_the_grants_tenant() {
        let (key, keys) = setup();
        let t = key.sign(&claims(
            "acme",
            vec![
                "tenant.manage:tenant:*".into(),
                "stream.manage:stream:globex/default/orders".into(),
            ],
        ));
        let g = keys.verify(&t, "acme", 1500).unwrap();
        assert!(g.allows_object("tenant.manage", "tenant", &["acme"]));
        assert!(g.allows_object("stream.manage", "stream", &["acme", "default", "x"]));
        assert!(!g.allows_object("tenant.manage", "tenant", &["globex"]));
        assert!(!g.allows_object("stream.manage", "stream", &["globex", "default", "orders"]));
        // The operator's cluster permissions still reach every tenant.
        let op = key.sign(&claims("acme", vec!["tenant.manage:cluster:*".into()]));
        let g = keys.verify(&op, "acme", 1500).unwrap();
        assert!(g.allows_object("tenant.manage", "tenant", &["globex"]));
    }

    #[test]
    fn a_good_token_verifies_and_its_perms_match_by_segment() {
        let (key, keys) = setup();
        let t = key.sign(&claims(
            "acme",
            vec!["stream.publish:stream:acme/default/*".into()],
        ));
        let g = keys.verify(&t, "acme", 1500).unwrap();
        assert!(g.allows(Action::StreamPublish, "default", "orders"));
        assert!(!g.allows(Action::StreamPublish, "other", "orders"));
        assert!(!g.allows(Action::StreamSubscribe, "default", "orders"));
        let admin = key.sign(&claims("acme", vec!["tenant.manage:tenant:acme".into()]));
        let g = keys.verify(&admin, "acme", 1500).unwrap();
        assert!(g.allows(Action::CacheWrite, "x", "y"));
    }

    /// Managing a group (redrive, discard) takes `group.manage` on it, or `stream.manage`
    /// on its stream; reading the stream does not reach it.
    #[test]
    fn managing_a_group_takes_group_or_stream_manage() {
        let reader = grant(&["stream.subscribe:stream:acme/default/orders"]);
        assert!(!reader.allows_group_manage("default", "orders", "g"));
        let group = grant(&["group.manage:group:acme/default/orders/g"]);
        assert!(group.allows_group_manage("default", "orders", "g"));
        assert!(!group.allows_group_manage("default", "orders", "h"));
        let groups = grant(&["group.manage:group:acme/default/orders/*"]);
        assert!(groups.allows_group_manage("default", "orders", "h"));
        assert!(!groups.allows_group_manage("default", "payments", "h"));
        let stream = grant(&["stream.manage:stream:acme/*/orders"]);
        assert!(stream.allows_group_manage("x", "orders", "g"));
        assert!(grant(&["tenant.manage:tenant:acme"]).allows_group_manage("x", "y", "z"));
        assert!(
            !grant(&["group.manage:group:globex/default/orders/g"])
                .allows_group_manage("default", "orders", "g")
        );
    }

    /// Consuming through a group takes `group.consume` on it, or `stream.subscribe` on
    /// its stream, which implies it: a token granted only `group.consume` was refused.
    #[test]
    fn consuming_through_a_group_takes_group_consume_or_stream_subscribe() {
        let reader = grant(&["stream.subscribe:stream:acme/default/orders"]);
        assert!(reader.allows_group_consume("default", "orders", "g"));
        assert!(!reader.allows_group_consume("default", "payments", "g"));
        let consumer = grant(&["group.consume:group:acme/default/orders/g"]);
        assert!(consumer.allows_group_consume("default", "orders", "g"));
        assert!(!consumer.allows_group_consume("default", "orders", "h"));
        assert!(!consumer.allows(Action::StreamSubscribe, "default", "orders"));
        assert!(!consumer.allows_group_manage("default", "orders", "g"));
        let any = grant(&["group.consume:group:acme/*/orders/*"]);
        assert!(any.allows_group_consume("x", "orders", "h"));
        assert!(
            !grant(&["group.consume:group:globex/default/orders/g"])
                .allows_group_consume("default", "orders", "g")
        );
        assert!(
            !grant(&["group.consume:stream:acme/default/orders"])
                .allows_group_consume("default", "orders", "g"),
            "a group grant names a group"
        );
    }

    /// A token that never expires (`exp` at the largest time) verifies: the skew added
    /// to it overflowed (a panic in a debug build, "expired" in a release one).
    #[test]
    fn a_token_expiring_at_the_end_of_time_verifies() {
        let (key, keys) = setup();
        let mut c = claims("acme", vec![]);
        c.exp = u64::MAX;
        c.nbf = Some(u64::MAX);
        keys.verify(&key.sign(&c), "acme", u64::MAX)
            .expect("it holds until the end of time");
    }

    #[test]
    fn forged_expired_foreign_and_misaddressed_tokens_are_refused() {
        let (key, keys) = setup();
        let good = key.sign(&claims("acme", vec![]));
        let mut forged = good.clone();
        let n = forged.len();
        forged.replace_range(n - 2..n, if good.ends_with("AA") { "BB" } else { "AA" });
        assert!(matches!(
            keys.verify(&forged, "acme", 1500),
            Err(AuthError::Signature(_)) | Err(AuthError::Malformed(_))
        ));
        assert_eq!(keys.verify(&good, "acme", 3000), Err(AuthError::Expired));
        assert!(matches!(
            keys.verify(&good, "other", 1500),
            Err(AuthError::UnknownTenant(_))
        ));
        let other_key = SigningKey::generate("k1").unwrap();
        let foreign = other_key.sign(&claims("acme", vec![]));
        assert!(matches!(
            keys.verify(&foreign, "acme", 1500),
            Err(AuthError::Signature(_))
        ));
        let mut c = claims("acme", vec![]);
        c.aud = "felix-controlplane".into();
        assert!(matches!(
            keys.verify(&key.sign(&c), "acme", 1500),
            Err(AuthError::Claim { claim: "aud", .. })
        ));
        let mut keys2 = keys.clone();
        keys2.add("beta", "k1", key.public_key());
        assert!(matches!(
            keys2.verify(&good, "beta", 1500),
            Err(AuthError::WrongTenant { .. })
        ));
        assert!(matches!(
            keys.verify("a.b", "acme", 1500),
            Err(AuthError::Malformed(_))
        ));
    }

    /// The token matrix of the fault harness: each way a token can be wrong, refused
    /// with its own error.
    #[test]
    fn the_token_matrix() {
        let (key, keys) = setup();
        let b64 = |v: &[u8]| URL_SAFE_NO_PAD.encode(v);
        let body = b64(&serde_json::to_vec(&claims("acme", vec![])).unwrap());
        // Not yet valid.
        let mut c = claims("acme", vec![]);
        c.nbf = Some(1900);
        assert_eq!(
            keys.verify(&key.sign(&c), "acme", 1500),
            Err(AuthError::Expired)
        );
        // Wrong issuer.
        let mut c = claims("acme", vec![]);
        c.iss = "someone-else".into();
        assert!(matches!(
            keys.verify(&key.sign(&c), "acme", 1500),
            Err(AuthError::Claim { claim: "iss", .. })
        ));
        // alg: none, no signature.
        let none = format!("{}.{body}.", b64(br#"{"alg":"none","typ":"JWT"}"#));
        assert!(matches!(
            keys.verify(&none, "acme", 1500),
            Err(AuthError::Algorithm(a)) if a == "none"
        ));
        // HS256 "signed" with the public key as the HMAC secret (the classic confusion).
        let header = b64(br#"{"alg":"HS256","typ":"JWT","kid":"k1"}"#);
        let input = format!("{header}.{body}");
        let hmac = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &key.public_key());
        let tag = ring::hmac::sign(&hmac, input.as_bytes());
        let hs = format!("{input}.{}", b64(tag.as_ref()));
        assert!(matches!(
            keys.verify(&hs, "acme", 1500),
            Err(AuthError::Algorithm(a)) if a == "HS256"
        ));
        // Unknown kid: a key this tenant does not have, even if the signature is good.
        let stranger = SigningKey::generate("k9").unwrap();
        let mut keys_with_k9_elsewhere = keys.clone();
        keys_with_k9_elsewhere.add("beta", "k9", stranger.public_key());
        assert!(matches!(
            keys_with_k9_elsewhere.verify(&stranger.sign(&claims("acme", vec![])), "acme", 1500),
            Err(AuthError::Signature(_))
        ));
        // A key revoked (removed from the set) refuses what it signed.
        let good = key.sign(&claims("acme", vec![]));
        let mut revoked = TenantKeys::default();
        revoked.add(
            "acme",
            "k2",
            SigningKey::generate("k2").unwrap().public_key(),
        );
        assert!(matches!(
            revoked.verify(&good, "acme", 1500),
            Err(AuthError::Signature(_))
        ));
    }
}
