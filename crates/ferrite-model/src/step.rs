//! One engine step flattened onto a single token axis, as the model consumes it.

/// No padding anywhere: `T` is the sum of every request's new tokens this step.
#[derive(Clone, Debug, Default)]
pub struct PackedStep {
    /// `[T]`
    pub input_ids: Vec<u32>,
    /// `[T]`: each token's own position in its request.
    pub positions: Vec<u32>,
    /// `[B + 1]`
    pub cu_seqlens_q: Vec<u32>,
    /// `[B]`: K/V length after this step.
    pub seq_lens_k: Vec<u32>,
    /// `[B, max_blocks]`, row-major, unused entries 0.
    pub block_tables: Vec<u32>,
    pub max_blocks: usize,
    /// `[T]`: cache slot (`block * block_size + offset`) of each new token.
    pub slot_mapping: Vec<u32>,
    /// Rows whose logits are needed (sampled tokens, prompt logprobs).
    pub logits_indices: Vec<u32>,
}

impl PackedStep {
    pub fn num_tokens(&self) -> usize {
        self.input_ids.len()
    }

    pub fn num_seqs(&self) -> usize {
        self.seq_lens_k.len()
    }

    /// Appends one request's chunk: `tokens` at positions `start..`, K/V in `blocks`.
    pub fn push(&mut self, tokens: &[u32], start: usize, blocks: &[u32], block_size: usize) {
        if self.cu_seqlens_q.is_empty() {
            self.cu_seqlens_q.push(0);
        }
        for (i, &tok) in tokens.iter().enumerate() {
            let pos = start + i;
            self.input_ids.push(tok);
            self.positions.push(pos as u32);
            let block = blocks[pos / block_size];
            self.slot_mapping
                .push(block * block_size as u32 + (pos % block_size) as u32);
        }
        self.cu_seqlens_q.push(self.input_ids.len() as u32);
        self.seq_lens_k.push((start + tokens.len()) as u32);
        // Block tables are stored ragged until `finish` pads them to one width.
        self.block_tables.extend_from_slice(blocks);
        self.block_tables.push(u32::MAX);
    }

    /// The start-up profiling step: one request of `tokens` prompt tokens in blocks
    /// `0..`, its last row sampled.
    pub fn profile(tokens: usize, block_size: usize, vocab_size: usize) -> Self {
        let mut step = Self::default();
        let ids: Vec<u32> = (0..tokens as u32).map(|i| i % vocab_size as u32).collect();
        let table: Vec<u32> = (0..tokens.div_ceil(block_size) as u32).collect();
        step.push(&ids, 0, &table, block_size);
        step.logits_indices.push(tokens as u32 - 1);
        step.finish();
        step
    }

    /// Lays the block tables out as `[B, max_blocks]`.
    pub fn finish(&mut self) {
        let rows: Vec<&[u32]> = self.block_tables.split(|&b| b == u32::MAX).collect();
        let rows = &rows[..self.num_seqs()];
        let width = rows.iter().map(|r| r.len()).max().unwrap_or(0);
        let mut table = vec![0u32; rows.len() * width];
        for (i, r) in rows.iter().enumerate() {
            table[i * width..i * width + r.len()].copy_from_slice(r);
        }
        self.block_tables = table;
        self.max_blocks = width;
    }
}
