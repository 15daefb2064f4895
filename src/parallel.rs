//! A pointer handed to candle's worker pool so that each work item can write its own
//! disjoint part of one output buffer (attention's per-head rows, a matmul's column tiles).

/// An output pointer shared by workers that write disjoint ranges. Whoever creates one
/// guarantees the ranges do not overlap and the buffer outlives the parallel region.
#[derive(Clone, Copy)]
pub(crate) struct SyncPtr(pub(crate) *mut f32);
// SAFETY: only used for disjoint writes; see the callers' SAFETY comments.
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}
impl SyncPtr {
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}
