//! The step contract: what the runner, a family and a backend exchange each step. It sits at
//! the bottom of the crate and imports nothing above it.

mod draws;
mod model;
mod packed;

pub use draws::{draw_params, mask_words, DeviceDraws, Masks, RowDraw, DRAW_PARAMS};
pub use model::StepModel;
pub use packed::{KvTables, PackedStep, StepHidden, StepPooling, StepState, NO_SLOT};
