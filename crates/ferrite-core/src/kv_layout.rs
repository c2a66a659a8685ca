//! How a model's layers map onto the KV pool (vLLM's per-layer-group KV specs). Layers are
//! split into groups of equal size, each with its own block table: full-attention groups
//! keep every block, sliding-window groups only the blocks their window can still read. A
//! page (one block id) holds `block_size` tokens of one layer of every group, so pages move
//! freely between groups: a short request costs what it costs with every layer global, and
//! a long one costs its global layers' whole context plus its local layers' window.

/// Per group: `None` for full attention, or the window in tokens.
pub type GroupWindow = Option<usize>;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub groups: Vec<GroupWindow>,
    /// Per layer: its group, and its slot within the group (which of a page's layers it is).
    pub layer_group: Vec<usize>,
    pub layer_slot: Vec<usize>,
    /// Layers per group: the layers a page holds.
    pub slots: usize,
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl KvLayout {
    /// Every layer reads the whole context: one group.
    pub fn full(num_layers: usize) -> Self {
        Self::new(&vec![None; num_layers])
    }

    /// The layout of layers with these windows: layers of one window are cut into groups
    /// of `gcd` of the per-window layer counts, in layer order.
    pub fn new(layer_windows: &[GroupWindow]) -> Self {
        let mut kinds: Vec<GroupWindow> = Vec::new();
        for w in layer_windows {
            if !kinds.contains(w) {
                kinds.push(*w);
            }
        }
        let count = |k: &GroupWindow| layer_windows.iter().filter(|w| *w == k).count();
        let slots = kinds.iter().map(count).fold(0, gcd).max(1);
        let mut groups = Vec::new();
        let mut first_group = Vec::new();
        for k in &kinds {
            first_group.push(groups.len());
            groups.extend(std::iter::repeat_n(*k, count(k) / slots));
        }
        let mut seen = vec![0; kinds.len()];
        let (mut layer_group, mut layer_slot) = (Vec::new(), Vec::new());
        for w in layer_windows {
            let kind = kinds.iter().position(|k| k == w).expect("listed above");
            let (n, per_kind) = (seen[kind], count(w) / slots);
            layer_group.push(first_group[kind] + n % per_kind);
            layer_slot.push(n / per_kind);
            seen[kind] += 1;
        }
        Self {
            groups,
            layer_group,
            layer_slot,
            slots,
        }
    }

    pub fn num_layers(&self) -> usize {
        self.layer_group.len()
    }

    pub fn has_windows(&self) -> bool {
        self.groups.iter().any(Option::is_some)
    }

    /// The most blocks one request of `tokens` tokens holds at once: see [`max_blocks`].
    pub fn max_blocks(&self, tokens: usize, block_size: usize, chunk: usize) -> usize {
        max_blocks(&self.groups, tokens, block_size, chunk)
    }
}

/// The most blocks one request of `tokens` tokens holds at once, over all groups, when its
/// steps compute at most `chunk` tokens: a window group keeps the blocks from the first key
/// of the chunk's first query to the chunk's end.
pub fn max_blocks(groups: &[GroupWindow], tokens: usize, block_size: usize, chunk: usize) -> usize {
    let all = tokens.div_ceil(block_size);
    groups
        .iter()
        .map(|w| match w {
            None => all,
            Some(w) => all.min((w - 1 + chunk).div_ceil(block_size) + 1),
        })
        .sum()
}

/// The first block a window group still needs when the next query is at position `next`:
/// a query at `p` reads keys `p - window + 1 ..= p`.
pub fn first_needed_block(window: usize, next: usize, block_size: usize) -> usize {
    (next + 1).saturating_sub(window) / block_size
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemma3_layers_form_one_global_and_five_local_groups() {
        // Five local layers to each global one, as Gemma 3 270M's 18.
        let w: Vec<GroupWindow> = (0..18).map(|i| ((i + 1) % 6 != 0).then_some(512)).collect();
        let l = KvLayout::new(&w);
        assert_eq!(l.slots, 3);
        assert_eq!(l.groups.iter().filter(|g| g.is_none()).count(), 1);
        assert_eq!(l.groups.len(), 6);
        // Every (group, slot) pair is taken by exactly one layer.
        let mut pairs: Vec<_> = l.layer_group.iter().zip(&l.layer_slot).collect();
        pairs.sort();
        pairs.dedup();
        assert_eq!(pairs.len(), 18);
        for (i, &g) in l.layer_group.iter().enumerate() {
            assert_eq!(l.groups[g], w[i]);
        }
        // A 32K request: 2048 blocks of the global group, 5 x 65 of the local ones.
        assert_eq!(l.max_blocks(32768, 16, 512), 2048 + 5 * 65);
        assert_eq!(KvLayout::full(18).max_blocks(32768, 16, 512), 2048);
    }

    #[test]
    fn a_uniform_model_is_one_group_in_layer_order() {
        let l = KvLayout::full(30);
        assert_eq!((l.groups.len(), l.slots), (1, 30));
        assert_eq!(l.layer_slot, (0..30).collect::<Vec<_>>());
        let m = KvLayout::new(&[Some(4096); 32]);
        assert_eq!(m.groups, vec![Some(4096)]);
    }

    #[test]
    fn first_needed_block_keeps_the_window() {
        // Window 16, block 4: a query at 20 reads 5..=20, so block 1 (4..8) is still needed.
        assert_eq!(first_needed_block(16, 20, 4), 1);
        assert_eq!(first_needed_block(16, 23, 4), 2);
        assert_eq!(first_needed_block(16, 3, 4), 0);
    }
}
