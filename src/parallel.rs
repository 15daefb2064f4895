//! A pointer handed to candle's worker pool so that each work item can write its own
//! disjoint part of one output buffer (attention's per-head rows, a matmul's column tiles).

/// An output pointer shared by workers that write disjoint ranges. Whoever creates one
/// guarantees the ranges do not overlap and the buffer outlives the parallel region.
pub(crate) struct SyncPtr<T = f32>(pub(crate) *mut T);
// Not derived: the derives would require `T: Clone`, and a pointer is copyable whatever `T`.
impl<T> Clone for SyncPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SyncPtr<T> {}
// SAFETY: only used for disjoint writes; see the callers' SAFETY comments.
unsafe impl<T> Send for SyncPtr<T> {}
unsafe impl<T> Sync for SyncPtr<T> {}
impl<T> SyncPtr<T> {
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}
