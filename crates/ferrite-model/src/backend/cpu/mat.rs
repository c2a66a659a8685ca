//! A row-major f32 matrix: the CPU backend's activations.

/// Row-major activations; `rows = data.len() / cols`.
#[derive(Default)]
pub struct Mat {
    pub data: Vec<f32>,
    pub cols: usize,
}

impl Mat {
    pub(super) fn rows(&self) -> usize {
        self.data.len().checked_div(self.cols).unwrap_or(0)
    }

    /// Resized to `[rows, cols]`, allocating only past its capacity.
    pub(super) fn shape(&mut self, rows: usize, cols: usize) -> &mut [f32] {
        self.cols = cols;
        self.data.resize(rows * cols, 0.0);
        &mut self.data
    }
}
