//! Tenants' private signing keys at rest: sealed with a key-encryption key (KEK) the
//! operator supplies, so the metadata store alone never yields a usable signing key.
//!
//! A sealed key is AES-256-GCM over the key's PKCS#8 bytes, with a fresh random 96-bit
//! nonce per seal and the tenant and key id as associated data (a sealed key copied to
//! another tenant's row does not open). Each row names the KEK that sealed it by id (the
//! first 8 bytes of SHA-256 over the KEK, hex): at start the service opens every row
//! with the KEK it names (the current one or a configured previous one) and seals again
//! with the current KEK what another sealed, or what an older version stored in clear.
//! Rotating the KEK is therefore: configure the new KEK as current and the old one as
//! previous, start once, then drop the old one (`docs/security.md`).

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::rand::{SecureRandom, SystemRandom};
use serde::{Deserialize, Serialize};

/// Bytes in a KEK.
pub const KEK_BYTES: usize = 32;

/// Why a KEK could not be loaded or a key opened.
#[derive(Debug, thiserror::Error)]
pub enum SealError {
    /// A KEK file that could not be read or is not 32 bytes in base64.
    #[error("key-encryption key {source_name}: {message}")]
    BadKek {
        /// The file or variable.
        source_name: String,
        /// What is wrong.
        message: String,
    },
    /// A row sealed by a KEK that is not configured.
    #[error(
        "signing key {key} is sealed with key-encryption key {kek}, which is not configured \
         (give it as a previous key-encryption key)"
    )]
    UnknownKek {
        /// The row.
        key: String,
        /// The KEK id it names.
        kek: String,
    },
    /// The ciphertext does not open (tampered, or moved between rows).
    #[error("signing key {0} does not open with its key-encryption key (tampered or moved)")]
    Tampered(String),
}

/// A sealed private key as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sealed {
    /// The id of the KEK that sealed it.
    pub kek: String,
    /// The nonce, base64.
    pub nonce: String,
    /// Ciphertext and tag, base64.
    pub ciphertext: String,
}

struct Kek {
    id: String,
    key: LessSafeKey,
}

impl Kek {
    fn new(material: &[u8; KEK_BYTES]) -> Kek {
        let digest = ring::digest::digest(&ring::digest::SHA256, material);
        let id = digest.as_ref()[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let key = LessSafeKey::new(
            UnboundKey::new(&AES_256_GCM, material).expect("a 32-byte AES-256 key"),
        );
        Kek { id, key }
    }
}

/// The current KEK and any previous ones still accepted for opening.
pub struct Keyring {
    current: Kek,
    previous: Vec<Kek>,
    /// Made at start for an in-memory store; never written anywhere.
    ephemeral: bool,
    rng: SystemRandom,
}

impl std::fmt::Debug for Keyring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keyring")
            .field("current", &self.current.id)
            .field(
                "previous",
                &self.previous.iter().map(|k| &k.id).collect::<Vec<_>>(),
            )
            .field("ephemeral", &self.ephemeral)
            .finish()
    }
}

fn aad(key: &str) -> Vec<u8> {
    format!("felix-signing-key\0{key}").into_bytes()
}

/// Parses KEK material: 32 bytes in standard base64 (surrounding whitespace ignored).
pub fn parse_kek(text: &str, source_name: &str) -> Result<[u8; KEK_BYTES], SealError> {
    let bad = |message: String| SealError::BadKek {
        source_name: source_name.to_owned(),
        message,
    };
    let bytes = STANDARD
        .decode(text.trim())
        .map_err(|e| bad(format!("not base64: {e}")))?;
    bytes
        .try_into()
        .map_err(|b: Vec<u8>| bad(format!("{} bytes, expected {KEK_BYTES}", b.len())))
}

/// Reads a KEK file (`openssl rand -base64 32 > kek`).
pub fn read_kek(path: &std::path::Path) -> Result<[u8; KEK_BYTES], SealError> {
    let name = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| SealError::BadKek {
        source_name: name.clone(),
        message: e.to_string(),
    })?;
    parse_kek(&text, &name)
}

impl Keyring {
    /// A keyring from KEK material: `current` seals, every one opens.
    pub fn new(current: &[u8; KEK_BYTES], previous: &[[u8; KEK_BYTES]]) -> Keyring {
        Keyring {
            current: Kek::new(current),
            previous: previous.iter().map(Kek::new).collect(),
            ephemeral: false,
            rng: SystemRandom::new(),
        }
    }

    /// A random KEK held only in this process: for the in-memory store, whose rows die
    /// with the process anyway.
    pub fn ephemeral() -> Keyring {
        let mut material = [0u8; KEK_BYTES];
        SystemRandom::new()
            .fill(&mut material)
            .expect("the system random source");
        Keyring {
            ephemeral: true,
            ..Keyring::new(&material, &[])
        }
    }

    /// Whether this keyring was made up at start.
    pub fn is_ephemeral(&self) -> bool {
        self.ephemeral
    }

    /// The id of the KEK that seals.
    pub fn current_id(&self) -> &str {
        &self.current.id
    }

    /// Seals `pkcs8` for the row `key` (`tenant/kid`).
    pub fn seal(&self, key: &str, pkcs8: &[u8]) -> Sealed {
        let mut nonce = [0u8; NONCE_LEN];
        self.rng.fill(&mut nonce).expect("the system random source");
        let mut data = pkcs8.to_vec();
        self.current
            .key
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(aad(key)),
                &mut data,
            )
            .expect("AES-GCM seals any length we store");
        Sealed {
            kek: self.current.id.clone(),
            nonce: STANDARD.encode(nonce),
            ciphertext: STANDARD.encode(data),
        }
    }

    /// Opens the sealed key of row `key`.
    pub fn open(&self, key: &str, sealed: &Sealed) -> Result<Vec<u8>, SealError> {
        let kek = std::iter::once(&self.current)
            .chain(&self.previous)
            .find(|k| k.id == sealed.kek)
            .ok_or_else(|| SealError::UnknownKek {
                key: key.to_owned(),
                kek: sealed.kek.clone(),
            })?;
        let tampered = || SealError::Tampered(key.to_owned());
        let nonce: [u8; NONCE_LEN] = STANDARD
            .decode(&sealed.nonce)
            .ok()
            .and_then(|n| n.try_into().ok())
            .ok_or_else(tampered)?;
        let mut data = STANDARD
            .decode(&sealed.ciphertext)
            .map_err(|_| tampered())?;
        let plain = kek
            .key
            .open_in_place(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(aad(key)),
                &mut data,
            )
            .map_err(|_| tampered())?;
        Ok(plain.to_vec())
    }

    /// Whether a row sealed by `kek` should be sealed again with the current KEK.
    pub fn stale(&self, kek: &str) -> bool {
        kek != self.current.id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_key_opens_only_for_its_row_and_with_a_known_kek() {
        let (a, b) = ([7u8; 32], [9u8; 32]);
        let ring = Keyring::new(&a, &[]);
        let sealed = ring.seal("acme/k1", b"private bytes");
        assert_ne!(
            STANDARD.decode(&sealed.ciphertext).unwrap()[..13],
            b"private bytes"[..]
        );
        assert_eq!(ring.open("acme/k1", &sealed).unwrap(), b"private bytes");
        // Moved to another tenant's row: refused.
        assert!(matches!(
            ring.open("evil/k1", &sealed),
            Err(SealError::Tampered(_))
        ));
        // One flipped bit: refused.
        let mut flipped = sealed.clone();
        let mut ct = STANDARD.decode(&flipped.ciphertext).unwrap();
        ct[0] ^= 1;
        flipped.ciphertext = STANDARD.encode(ct);
        assert!(ring.open("acme/k1", &flipped).is_err());
        // After rotation the old KEK still opens it (as previous) and the row is stale.
        let rotated = Keyring::new(&b, &[a]);
        assert!(rotated.stale(&sealed.kek));
        assert_eq!(rotated.open("acme/k1", &sealed).unwrap(), b"private bytes");
        // Without the old KEK it names which one is missing.
        let err = Keyring::new(&b, &[]).open("acme/k1", &sealed).unwrap_err();
        assert!(err.to_string().contains(&sealed.kek), "{err}");
        // Two seals of one key differ (fresh nonce).
        assert_ne!(ring.seal("acme/k1", b"x"), ring.seal("acme/k1", b"x"));
    }

    #[test]
    fn kek_material_must_be_32_bytes_of_base64() {
        assert!(parse_kek(&STANDARD.encode([1u8; 32]), "t").is_ok());
        let e = parse_kek(&STANDARD.encode([1u8; 16]), "t").unwrap_err();
        assert!(e.to_string().contains("16 bytes"), "{e}");
        assert!(parse_kek("not base64!", "t").is_err());
    }
}
