//! Chained hashes of full KV blocks: a block's hash covers its parent's hash, its token ids and
//! extra keys (a tenant's `cache_salt`), so equal hashes mean equal prefixes.

use sha2::{Digest, Sha256};
use std::hash::{Hash, Hasher};

pub type BlockHash = [u8; 32];

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum HashAlgo {
    /// Collision-resistant: safe when tenants could be adversaries.
    #[default]
    Sha256,
    /// 64-bit SipHash: cheaper; hits are confirmed by comparing token ids.
    Builtin,
}

impl HashAlgo {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "sha256" => Ok(HashAlgo::Sha256),
            "builtin" => Ok(HashAlgo::Builtin),
            other => Err(format!(
                "unknown prefix caching hash algorithm `{other}` (sha256, builtin)"
            )),
        }
    }

    /// True when a hash match must be confirmed by comparing token ids.
    pub fn needs_token_check(self) -> bool {
        self == HashAlgo::Builtin
    }

    pub fn block_hash(
        self,
        parent: Option<&BlockHash>,
        tokens: &[u32],
        salt: Option<&str>,
    ) -> BlockHash {
        match self {
            HashAlgo::Sha256 => {
                let mut h = Sha256::new();
                h.update(parent.map_or(&[0u8; 32][..], |p| &p[..]));
                for t in tokens {
                    h.update(t.to_le_bytes());
                }
                if let Some(s) = salt {
                    h.update(b"salt:");
                    h.update(s.as_bytes());
                }
                h.finalize().into()
            }
            HashAlgo::Builtin => {
                let mut h = std::collections::hash_map::DefaultHasher::new();
                parent.hash(&mut h);
                tokens.hash(&mut h);
                salt.hash(&mut h);
                let mut out = [0u8; 32];
                out[..8].copy_from_slice(&h.finish().to_le_bytes());
                out
            }
        }
    }
}

/// Hashes of the full blocks of `tokens`, continuing the chain in `hashes`. The salt enters
/// the first block only; the chain carries it to every later block.
pub fn extend_block_hashes(
    algo: HashAlgo,
    hashes: &mut Vec<BlockHash>,
    tokens: &[u32],
    block_size: usize,
    salt: Option<&str>,
) {
    let full = tokens.len() / block_size;
    for b in hashes.len()..full {
        let parent = b.checked_sub(1).map(|p| hashes[p]);
        let h = algo.block_hash(
            parent.as_ref(),
            &tokens[b * block_size..(b + 1) * block_size],
            if b == 0 { salt } else { None },
        );
        hashes.push(h);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_depends_on_prefix_tokens_and_salt() {
        for algo in [HashAlgo::Sha256, HashAlgo::Builtin] {
            let mut a = Vec::new();
            extend_block_hashes(algo, &mut a, &[1, 2, 3, 4, 5, 6, 7], 2, None);
            assert_eq!(a.len(), 3);
            let mut b = Vec::new();
            extend_block_hashes(algo, &mut b, &[9, 2, 3, 4, 5, 6], 2, None);
            // Same tokens in block 1, different parent: different hash.
            assert_ne!(a[1], b[1]);
            let mut c = Vec::new();
            extend_block_hashes(algo, &mut c, &[1, 2, 3, 4], 2, Some("tenant"));
            assert_ne!(a[0], c[0]);
            assert_ne!(a[1], c[1]);
            let mut d = a[..1].to_vec();
            extend_block_hashes(algo, &mut d, &[1, 2, 3, 4, 5, 6, 7, 8], 2, None);
            assert_eq!(&d[..3], &a[..]);
        }
    }
}
