//! A suffix tree truncated to a depth: every substring of the indexed token sequences up to
//! `max_depth` tokens long is a path from a root, and each node counts how many times its
//! substring occurs. The children of the node for a matched context suffix are what followed
//! that suffix, with how often: the frequencies a speculation tree is scored by.
//!
//! Nodes live in one arena (freed nodes are reused) and edges in one hash map, so several
//! roots (one per scope of the shared cache) share the memory budget. Removing a sequence
//! walks the same paths its insertion did and frees the nodes whose count reaches zero: a
//! child never occurs more often than its parent, so a node at zero has no live children.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

const NONE: u32 = u32::MAX;

/// Bytes one live node costs, the arena slot and its edge entry with the hash map's slack
/// (it doubles when it grows): what the memory budget is counted in.
pub const BYTES_PER_NODE: usize = 24 + 2 * 20;

#[derive(Debug, Clone, Copy)]
struct Node {
    count: u32,
    token: u32,
    parent: u32,
    first_child: u32,
    prev_sibling: u32,
    next_sibling: u32,
}

/// Multiplicative hashing for the (parent, token) edge keys: they are not attacker-chosen in
/// a way that matters (a collision only costs time, and the keys are bounded by the budget).
#[derive(Default)]
struct EdgeHasher(u64);

impl Hasher for EdgeHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ b as u64).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (v ^ (v >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        self.0 ^= self.0 >> 32;
    }
}

fn edge(parent: u32, token: u32) -> u64 {
    (parent as u64) << 32 | token as u64
}

/// One continuation in a speculation tree: `token` under `parent_row` (0: the context),
/// with the estimated probability `score` that the target writes the path down to it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Continuation {
    pub token: u32,
    pub parent_row: u32,
    pub score: f64,
}

#[derive(Debug)]
pub struct SuffixTrie {
    max_depth: usize,
    nodes: Vec<Node>,
    edges: HashMap<u64, u32, BuildHasherDefault<EdgeHasher>>,
    free: Vec<u32>,
}

impl SuffixTrie {
    pub fn new(max_depth: usize) -> Self {
        Self { max_depth: max_depth.max(1), nodes: Vec::new(), edges: HashMap::default(), free: Vec::new() }
    }

    pub fn max_depth(&self) -> usize {
        self.max_depth
    }

    /// Nodes in use (roots included).
    pub fn live_nodes(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    fn alloc(&mut self, token: u32, parent: u32) -> u32 {
        let node = Node { count: 0, token, parent, first_child: NONE, prev_sibling: NONE, next_sibling: NONE };
        match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        }
    }

    /// A new, empty root.
    pub fn new_root(&mut self) -> u32 {
        self.alloc(NONE, NONE)
    }

    /// Frees a root that has no children left.
    pub fn free_root(&mut self, root: u32) {
        debug_assert_eq!(self.nodes[root as usize].first_child, NONE);
        self.free.push(root);
    }

    pub fn is_empty_root(&self, root: u32) -> bool {
        self.nodes[root as usize].first_child == NONE
    }

    pub fn child(&self, node: u32, token: u32) -> Option<u32> {
        self.edges.get(&edge(node, token)).copied()
    }

    fn child_or_insert(&mut self, node: u32, token: u32) -> u32 {
        if let Some(c) = self.child(node, token) {
            return c;
        }
        let c = self.alloc(token, node);
        let first = self.nodes[node as usize].first_child;
        self.nodes[c as usize].next_sibling = first;
        if first != NONE {
            self.nodes[first as usize].prev_sibling = c;
        }
        self.nodes[node as usize].first_child = c;
        self.edges.insert(edge(node, token), c);
        c
    }

    fn unlink_and_free(&mut self, node: u32) {
        let n = self.nodes[node as usize];
        if n.prev_sibling != NONE {
            self.nodes[n.prev_sibling as usize].next_sibling = n.next_sibling;
        } else {
            self.nodes[n.parent as usize].first_child = n.next_sibling;
        }
        if n.next_sibling != NONE {
            self.nodes[n.next_sibling as usize].prev_sibling = n.prev_sibling;
        }
        self.edges.remove(&edge(n.parent, n.token));
        self.free.push(node);
    }

    /// Nodes the insertion of `tokens` would add at most (a budget check before inserting).
    pub fn nodes_for(&self, tokens: usize) -> usize {
        tokens * self.max_depth
    }

    /// Indexes `tokens[from..]` under `root`, where `tokens[..from]` is already indexed there
    /// as one sequence: every substring that ends at or after `from` is counted once.
    pub fn extend(&mut self, root: u32, tokens: &[u32], from: usize) {
        let from = from.min(tokens.len());
        for start in from.saturating_sub(self.max_depth - 1)..tokens.len() {
            let end = (start + self.max_depth).min(tokens.len());
            // Substrings ending before `from` were counted by the earlier call.
            let mut node = root;
            for (i, &t) in tokens[start..end].iter().enumerate() {
                node = self.child_or_insert(node, t);
                if start + i >= from {
                    let n = &mut self.nodes[node as usize];
                    n.count = n.count.saturating_add(1);
                }
            }
        }
    }

    /// Undoes [`Self::extend`]`(root, tokens, 0)`.
    pub fn remove(&mut self, root: u32, tokens: &[u32]) {
        for start in 0..tokens.len() {
            let end = (start + self.max_depth).min(tokens.len());
            let mut node = root;
            let mut dead = Vec::new();
            for &t in &tokens[start..end] {
                let Some(c) = self.child(node, t) else { break };
                let n = &mut self.nodes[c as usize];
                n.count = n.count.saturating_sub(1);
                if n.count == 0 {
                    dead.push(c);
                }
                node = c;
            }
            // Deepest first, so that each is a leaf when it goes.
            for &c in dead.iter().rev() {
                self.unlink_and_free(c);
            }
        }
    }

    /// The node of `path` under `root`, if the path occurs.
    pub fn find(&self, root: u32, path: &[u32]) -> Option<u32> {
        path.iter().try_fold(root, |node, &t| self.child(node, t))
    }

    pub fn count(&self, node: u32) -> u32 {
        self.nodes[node as usize].count
    }

    fn children(&self, node: u32) -> impl Iterator<Item = u32> + '_ {
        let mut c = self.nodes[node as usize].first_child;
        std::iter::from_fn(move || {
            (c != NONE).then(|| {
                let this = c;
                c = self.nodes[c as usize].next_sibling;
                this
            })
        })
    }

    /// The speculation tree below `node` (a matched context suffix at depth `depth`, seen
    /// `seen` times with a continuation): up to `max_nodes` continuations, most probable
    /// first, each scored by the product of `count(child) / count(parent)` along its path,
    /// none below `min_score`; only the most probable child of each node when `!tree` (a
    /// chain). Parents come before children.
    pub fn speculate(
        &self,
        node: u32,
        depth: usize,
        seen: u32,
        max_nodes: usize,
        min_score: f64,
        tree: bool,
    ) -> Vec<Continuation> {
        let mut out: Vec<Continuation> = Vec::new();
        // Candidates: (score, trie node, parent row, depth below the match).
        let mut frontier: Vec<(f64, u32, u32, usize)> = Vec::new();
        let room = self.max_depth.saturating_sub(depth);
        let push_children =
            |frontier: &mut Vec<(f64, u32, u32, usize)>, from: u32, score: f64, row: u32, below: usize| {
                if below >= room {
                    return;
                }
                let total = if from == node { seen } else { self.count(from) }.max(1) as f64;
                if tree {
                    for c in self.children(from) {
                        let s = score * self.count(c) as f64 / total;
                        if s >= min_score {
                            frontier.push((s, c, row, below + 1));
                        }
                    }
                } else if let Some(c) = self.children(from).max_by_key(|&c| (self.count(c), std::cmp::Reverse(c))) {
                    let s = score * self.count(c) as f64 / total;
                    if s >= min_score {
                        frontier.push((s, c, row, below + 1));
                    }
                }
            };
        push_children(&mut frontier, node, 1.0, 0, 0);
        while out.len() < max_nodes {
            // Frontiers are small (a few dozen): a scan beats a heap's bookkeeping.
            let Some(best) = (0..frontier.len())
                .max_by(|&a, &b| frontier[a].0.total_cmp(&frontier[b].0).then(frontier[b].1.cmp(&frontier[a].1)))
            else {
                break;
            };
            let (score, c, row, below) = frontier.swap_remove(best);
            out.push(Continuation { token: self.nodes[c as usize].token, parent_row: row, score });
            let my_row = out.len() as u32;
            push_children(&mut frontier, c, score, my_row, below);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Occurrences of `pattern` in `text` (possibly overlapping).
    fn occurrences(text: &[u32], pattern: &[u32]) -> u32 {
        text.windows(pattern.len()).filter(|w| *w == pattern).count() as u32
    }

    #[test]
    fn counts_every_substring_up_to_the_depth_and_extends_incrementally() {
        let text = [1, 2, 3, 1, 2, 4, 1, 2, 3, 3];
        let mut whole = SuffixTrie::new(4);
        let r = whole.new_root();
        whole.extend(r, &text, 0);
        let mut grown = SuffixTrie::new(4);
        let g = grown.new_root();
        let mut indexed = 0;
        for len in [3, 4, 7, 10] {
            grown.extend(g, &text[..len], indexed);
            indexed = len;
        }
        for len in 1..=4 {
            for w in text.windows(len) {
                let n = whole.find(r, w).unwrap();
                assert_eq!(whole.count(n), occurrences(&text, w), "{w:?}");
                assert_eq!(grown.count(grown.find(g, w).unwrap()), occurrences(&text, w), "{w:?}");
            }
        }
        assert!(whole.find(r, &[1, 2, 3, 1, 2]).is_none(), "deeper than the depth");
        assert_eq!(whole.live_nodes(), grown.live_nodes());
    }

    #[test]
    fn removing_every_sequence_frees_every_node() {
        let mut trie = SuffixTrie::new(5);
        let root = trie.new_root();
        let a = [7, 8, 9, 7, 8, 9, 10];
        let b = [8, 9, 10, 11, 7, 8];
        trie.extend(root, &a, 0);
        trie.extend(root, &b, 0);
        let with_both = trie.live_nodes();
        trie.remove(root, &a);
        // Only b's substrings are left, with b's counts.
        let mut only_b = SuffixTrie::new(5);
        let rb = only_b.new_root();
        only_b.extend(rb, &b, 0);
        assert_eq!(trie.live_nodes(), only_b.live_nodes());
        assert_eq!(trie.count(trie.find(root, &[8, 9]).unwrap()), 1);
        assert!(trie.find(root, &[9, 7]).is_none());
        trie.remove(root, &b);
        assert!(trie.is_empty_root(root));
        assert_eq!(trie.live_nodes(), 1);
        assert!(trie.edges.is_empty());
        // Freed slots are reused.
        trie.extend(root, &a, 0);
        assert!(trie.nodes.len() <= with_both);
    }

    #[test]
    fn speculation_follows_the_most_frequent_continuations() {
        let mut trie = SuffixTrie::new(8);
        let root = trie.new_root();
        // After [5, 6]: 7 three times, 9 once; after [5, 6, 7]: 8 twice, 1 once.
        for seq in [[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 1], [5, 6, 9, 2]] {
            trie.extend(root, &seq, 0);
        }
        let node = trie.find(root, &[5, 6]).unwrap();
        let chain = trie.speculate(node, 2, 4, 8, 0.1, false);
        let tokens: Vec<u32> = chain.iter().map(|c| c.token).collect();
        assert_eq!(tokens, [7, 8]);
        assert_eq!(chain[0].score, 0.75);
        assert_eq!(chain[1].score, 0.5);
        let tree = trie.speculate(node, 2, 4, 8, 0.1, true);
        let got: Vec<(u32, u32)> = tree.iter().map(|c| (c.token, c.parent_row)).collect();
        assert_eq!(got, [(7, 0), (8, 1), (1, 1), (9, 0), (2, 4)]);
        // A budget and a floor cut it.
        assert_eq!(trie.speculate(node, 2, 4, 2, 0.1, true).len(), 2);
        assert_eq!(trie.speculate(node, 2, 4, 8, 0.4, true).len(), 2);
        // No room below the depth limit.
        assert!(trie.speculate(node, 8, 4, 8, 0.0, true).is_empty());
    }
}
