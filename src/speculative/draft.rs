//! What a drafter proposes for one sequence in one step: a chain of tokens, or a tree of
//! candidate continuations verified together in one forward.
//!
//! Rows: the target runs on the last committed token (row 0) followed by the draft's nodes
//! (node `i` is row `i + 1`). A node's parent is a row: 0 for the first drafted position,
//! `j + 1` for node `j`. Parents come before their children, so every prefix of the node
//! list is itself a tree, and a chain is the tree whose node `i` has parent row `i`.

use crate::kv::NO_PARENT;

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Draft {
    /// The drafted tokens, one per node (a chain: `d1..dk` in order).
    pub tokens: Vec<u32>,
    /// For stochastic drafters: `probs[i]` is the exact distribution `tokens[i]` was drawn
    /// from, given its parent and its earlier siblings (over token ids; missing trailing ids
    /// count as 0). `None` for deterministic drafters, which the verifier treats as one-hot
    /// at each token. A row that gives its own token no mass is treated as one-hot too.
    pub probs: Option<Vec<Vec<f32>>>,
    /// Node `i`'s parent row (`parents[i] <= i`); siblings in the order the drafter ranks
    /// them, best first. Empty: a chain.
    pub parents: Vec<u32>,
}

impl Draft {
    /// A deterministic chain (one-hot `q`).
    pub fn deterministic(tokens: Vec<u32>) -> Self {
        Self { tokens, probs: None, parents: Vec::new() }
    }

    /// A deterministic tree. A tree that is a chain is stored as one.
    ///
    /// # Panics
    /// If the lengths differ or a node's parent is not an earlier row (a drafter bug).
    pub fn tree(tokens: Vec<u32>, parents: Vec<u32>) -> Self {
        assert_eq!(tokens.len(), parents.len(), "a draft tree needs one parent per node");
        for (i, &p) in parents.iter().enumerate() {
            assert!(p as usize <= i, "draft tree node {i} has parent row {p}, not an earlier row");
        }
        let chain = parents.iter().enumerate().all(|(i, &p)| p as usize == i);
        Self { tokens, probs: None, parents: if chain { Vec::new() } else { parents } }
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    pub fn is_tree(&self) -> bool {
        !self.parents.is_empty()
    }

    /// The row node `node` follows.
    pub fn parent_row(&self, node: usize) -> usize {
        self.parents.get(node).map_or(node, |&p| p as usize)
    }

    /// Node indices from the first drafted position down to `node`.
    pub fn path(&self, node: usize) -> Vec<usize> {
        let mut path = vec![node];
        let mut row = self.parent_row(node);
        while row > 0 {
            path.push(row - 1);
            row = self.parent_row(row - 1);
        }
        path.reverse();
        path
    }

    /// The tokens on the path to `node`, `node`'s last.
    pub fn path_tokens(&self, node: usize) -> Vec<u32> {
        self.path(node).into_iter().map(|n| self.tokens[n]).collect()
    }

    /// The deepest path's length (a chain: its length).
    pub fn depth(&self) -> usize {
        let mut depth = vec![0usize; self.len() + 1];
        for node in 0..self.len() {
            depth[node + 1] = depth[self.parent_row(node)] + 1;
        }
        depth.into_iter().max().unwrap_or(0)
    }

    /// For each row `0..=len`, its children in sibling order.
    pub fn children(&self) -> Vec<Vec<usize>> {
        let mut children = vec![Vec::new(); self.len() + 1];
        for node in 0..self.len() {
            children[self.parent_row(node)].push(node);
        }
        children
    }

    /// The parent of every forward row (row 0 follows the cache), for
    /// [`crate::model::ForwardBatch::push_tree`].
    pub fn forward_parents(&self) -> Vec<u32> {
        std::iter::once(NO_PARENT).chain((0..self.len()).map(|n| self.parent_row(n) as u32)).collect()
    }

    /// Keeps the first `n` nodes (a prefix of the node list is a tree).
    pub fn truncate(&mut self, n: usize) {
        self.tokens.truncate(n);
        if let Some(probs) = self.probs.as_mut() {
            probs.truncate(n);
        }
        self.parents.truncate(n);
    }

    /// Keeps the nodes for which `keep(node, path tokens)` holds and whose ancestors are all
    /// kept; the others go, with everything below them.
    pub fn retain(&mut self, mut keep: impl FnMut(usize, &[u32]) -> bool) {
        // New row of each old row (row 0 stays); None: dropped.
        let mut new_row: Vec<Option<u32>> = vec![None; self.len() + 1];
        new_row[0] = Some(0);
        let mut kept = Vec::new();
        for node in 0..self.len() {
            let Some(parent) = new_row[self.parent_row(node)] else { continue };
            if keep(node, &self.path_tokens(node)) {
                kept.push((node, parent));
                new_row[node + 1] = Some(kept.len() as u32);
            }
        }
        if kept.len() == self.len() {
            return;
        }
        let tokens = kept.iter().map(|&(n, _)| self.tokens[n]).collect();
        let parents = kept.iter().map(|&(_, p)| p).collect();
        let probs = self.probs.take().map(|probs| kept.iter().map(|&(n, _)| probs[n].clone()).collect());
        *self = Self::tree(tokens, parents);
        self.probs = probs;
    }
}

/// One drafted position's candidates, best first: `(token, log-probability)`.
pub type Candidates = Vec<(u32, f32)>;

/// The tree of the `max_nodes` most probable paths (DDTree's best-first search), where
/// `positions[d]` ranks the candidates for depth `d` and a path's score is the sum of its
/// tokens' log-probabilities. With `chain_below_best`, only each position's best candidate
/// has children (a drafter whose next distribution is conditioned on its own best token:
/// the others are leaves). Nodes come out best first, so parents precede children and
/// siblings are in rank order; a budget of one node per position and one candidate each is
/// the chain.
pub fn best_first_tree(positions: &[Candidates], max_nodes: usize, chain_below_best: bool) -> Draft {
    use std::cmp::Ordering;
    use std::collections::BinaryHeap;
    #[derive(PartialEq)]
    struct Frontier {
        score: f32,
        parent_row: u32,
        depth: usize,
        rank: usize,
    }
    impl Eq for Frontier {}
    impl PartialOrd for Frontier {
        fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
            Some(self.cmp(other))
        }
    }
    impl Ord for Frontier {
        // Higher score first; among equals the shallower, then the better ranked.
        fn cmp(&self, other: &Self) -> Ordering {
            self.score.total_cmp(&other.score).then(other.depth.cmp(&self.depth)).then(other.rank.cmp(&self.rank))
        }
    }
    let mut tokens = Vec::new();
    let mut parents = Vec::new();
    let mut heap = BinaryHeap::new();
    if let Some(&(_, lp)) = positions.first().and_then(|c| c.first()) {
        heap.push(Frontier { score: lp, parent_row: 0, depth: 0, rank: 0 });
    }
    while tokens.len() < max_nodes {
        let Some(f) = heap.pop() else { break };
        let (token, lp) = positions[f.depth][f.rank];
        tokens.push(token);
        parents.push(f.parent_row);
        let row = tokens.len() as u32;
        if let Some(&(_, next_lp)) = positions[f.depth].get(f.rank + 1) {
            heap.push(Frontier { score: f.score - lp + next_lp, rank: f.rank + 1, ..f });
        }
        if !(chain_below_best && f.rank > 0) {
            if let Some(&(_, child_lp)) = positions.get(f.depth + 1).and_then(|c| c.first()) {
                heap.push(Frontier { score: f.score + child_lp, parent_row: row, depth: f.depth + 1, rank: 0 });
            }
        }
    }
    Draft::tree(tokens, parents)
}

/// Candidates per drafted position a chain drafter's tree keeps as leaves beside its best.
pub const CHAIN_TREE_CANDIDATES: usize = 3;

/// The tree of a drafter that drafts one position per step and continues only from its best
/// token (a draft model, EAGLE-3): `next(best)` returns the ranked candidates of the next
/// position after feeding `best` (None for the first), and the runner-ups become leaves.
/// It stops stepping once the newest best token no longer makes the `max_nodes` most
/// probable nodes (nothing below it would), at `max_depth`, or when `next` has nothing.
pub fn chain_with_alternatives(
    max_nodes: usize,
    max_depth: usize,
    mut next: impl FnMut(Option<u32>) -> anyhow::Result<Candidates>,
) -> anyhow::Result<Draft> {
    let mut positions: Vec<Candidates> = Vec::new();
    while positions.len() < max_depth.min(max_nodes) {
        let best = positions.last().map(|c| c[0].0);
        let candidates = next(best)?;
        if candidates.is_empty() {
            break;
        }
        positions.push(candidates);
        if best_first_tree(&positions, max_nodes, true).depth() < positions.len() {
            break;
        }
    }
    Ok(best_first_tree(&positions, max_nodes, true))
}

/// A node of a tree grown by [`expanding_tree`]: its token, depth (0: the first drafted
/// position), parent node (None: the committed context), path score (the sum of its path's
/// log-probabilities) and rank among its siblings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GrownNode {
    pub token: u32,
    pub depth: usize,
    pub parent: Option<usize>,
    pub score: f32,
    pub rank: usize,
}

/// Nodes of each depth an [`expanding_tree`] runs the drafter on (EAGLE-2's top-k expansion).
pub const EXPAND_WIDTH: usize = 3;

/// The dynamic draft tree of EAGLE-2 for a drafter that can run several nodes of one depth in
/// one pass (EAGLE-3): from the first position's ranked candidates (`root`), each depth expands
/// its `width` most probable nodes, `expand(nodes, chosen)` returning the ranked candidates
/// after each chosen node (the drafter run on it, conditioned on its own path); then the
/// `max_nodes` most probable nodes overall form the tree. It stops at `max_depth`, or once no
/// node left to expand scores above the `max_nodes`-th best (a child scores at most its
/// parent, so nothing below could enter the tree). Unlike [`chain_with_alternatives`], a
/// runner-up can have children, so a tree can follow the second choice where the drafter is
/// unsure. Nodes come out best first: parents before children, siblings in rank order.
pub fn expanding_tree(
    max_nodes: usize,
    max_depth: usize,
    width: usize,
    root: Candidates,
    mut expand: impl FnMut(&[GrownNode], &[usize]) -> anyhow::Result<Vec<Candidates>>,
) -> anyhow::Result<Draft> {
    let mut nodes: Vec<GrownNode> = Vec::new();
    let grow = |nodes: &mut Vec<GrownNode>, parent: Option<usize>, depth: usize, base: f32, candidates: &Candidates| {
        let start = nodes.len();
        for (rank, &(token, lp)) in candidates.iter().enumerate() {
            nodes.push(GrownNode { token, depth, parent, score: base + lp, rank });
        }
        (start..nodes.len()).collect::<Vec<_>>()
    };
    let mut frontier = grow(&mut nodes, None, 0, 0.0, &root);
    // Best first: higher score, then shallower, then better ranked (a parent before its child
    // even where a child's log-probability rounds to 0).
    let order = |nodes: &[GrownNode], a: usize, b: usize| {
        let (x, y) = (&nodes[a], &nodes[b]);
        y.score.total_cmp(&x.score).then(x.depth.cmp(&y.depth)).then(x.rank.cmp(&y.rank)).then(a.cmp(&b))
    };
    for depth in 1..max_depth.min(max_nodes) {
        let cutoff = if nodes.len() >= max_nodes {
            let mut scores: Vec<f32> = nodes.iter().map(|n| n.score).collect();
            scores.sort_by(|a, b| b.total_cmp(a));
            scores[max_nodes - 1]
        } else {
            f32::NEG_INFINITY
        };
        frontier.sort_by(|&a, &b| order(&nodes, a, b));
        let chosen: Vec<usize> = frontier.iter().copied().filter(|&n| nodes[n].score > cutoff).take(width).collect();
        if chosen.is_empty() {
            break;
        }
        let candidates = expand(&nodes, &chosen)?;
        frontier.clear();
        for (&n, c) in chosen.iter().zip(&candidates) {
            let base = nodes[n].score;
            frontier.extend(grow(&mut nodes, Some(n), depth, base, c));
        }
    }
    let mut ranked: Vec<usize> = (0..nodes.len()).collect();
    ranked.sort_by(|&a, &b| order(&nodes, a, b));
    // Rows in the draft (node i is row i + 1); a node joins only after its parent did.
    let mut row_of = vec![None; nodes.len()];
    let (mut tokens, mut parents) = (Vec::new(), Vec::new());
    for n in ranked {
        if tokens.len() == max_nodes {
            break;
        }
        let parent_row = match nodes[n].parent {
            None => 0,
            Some(p) => match row_of[p] {
                Some(r) => r,
                None => continue,
            },
        };
        tokens.push(nodes[n].token);
        parents.push(parent_row);
        row_of[n] = Some(tokens.len() as u32);
    }
    Ok(Draft::tree(tokens, parents))
}

/// The `k` most probable tokens of a logits row with their log-probabilities, best first
/// (ties to the lower id, as argmax). `map` turns a row index into a token id.
pub fn top_candidates(logits: &[f32], k: usize, map: impl Fn(u32) -> u32) -> Candidates {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() || k == 0 {
        return Vec::new();
    }
    // Only ranks and rough path scores depend on it: eight f32 partial sums (vectorised)
    // instead of a chain of f64 adds over the whole vocabulary.
    let mut partial = [0f32; 8];
    for chunk in logits.chunks(8) {
        for (p, &l) in partial.iter_mut().zip(chunk) {
            *p += (l - max).exp();
        }
    }
    let log_total = partial.iter().sum::<f32>().ln() + max;
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    for (i, &l) in logits.iter().enumerate() {
        if best.len() == k && l <= best[k - 1].1 {
            continue;
        }
        let at = best.partition_point(|&(_, b)| b >= l);
        best.insert(at, (i as u32, l));
        best.truncate(k);
    }
    best.into_iter().map(|(i, l)| (map(i), l - log_total)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_first_takes_the_most_probable_paths() {
        let ln = |p: f32| p.ln();
        // Depth 0: a 0.6, b 0.3; depth 1: c 0.45, d 0.4; depth 2: e 0.9.
        let positions = vec![vec![(1, ln(0.6)), (2, ln(0.3))], vec![(3, ln(0.45)), (4, ln(0.4))], vec![(5, ln(0.9))]];
        // Paths by probability: a .6, b .3, a-c .27, a-c-e .243, a-d .24, a-d-e .216, b-c .135.
        let tree = best_first_tree(&positions, 5, false);
        assert_eq!(tree.tokens, vec![1, 2, 3, 5, 4]);
        assert_eq!(tree.parents, vec![0, 0, 1, 3, 1]);
        let six = best_first_tree(&positions, 6, false);
        assert_eq!((six.tokens[5], six.parents[5]), (5, 5), "a-d-e is sixth, under a-d");
        // One candidate per position: the chain.
        let single: Vec<Candidates> = positions.iter().map(|c| c[..1].to_vec()).collect();
        assert_eq!(best_first_tree(&single, 8, false), Draft::deterministic(vec![1, 3, 5]));
        // Only the best continues: b and a-d are leaves, so the tree stops at five nodes.
        let leaves = best_first_tree(&positions, 8, true);
        assert_eq!(leaves.tokens, vec![1, 2, 3, 5, 4]);
        assert!(leaves.children()[2].is_empty(), "b has no children");
    }

    #[test]
    fn an_expanding_tree_follows_a_runner_up_where_the_drafter_is_unsure() {
        let ln = |p: f32| p.ln();
        // Two first tokens nearly as likely (a .5, b .45); after a the drafter is unsure (c .4,
        // d .35), after b sure (e .95). Each node's children: its token × 10 + rank.
        let table = |token: u32| -> Candidates {
            match token {
                1 => vec![(3, ln(0.4)), (4, ln(0.35))],
                2 => vec![(5, ln(0.95)), (6, ln(0.02))],
                t => vec![(t * 10, ln(0.9)), (t * 10 + 1, ln(0.05))],
            }
        };
        let mut expanded: Vec<Vec<u32>> = Vec::new();
        let tree = expanding_tree(5, 3, 2, vec![(1, ln(0.5)), (2, ln(0.45))], |nodes, chosen| {
            let depths: Vec<usize> = chosen.iter().map(|&n| nodes[n].depth).collect();
            assert!(depths.iter().all(|&d| d == depths[0]), "one depth per pass: {depths:?}");
            expanded.push(chosen.iter().map(|&n| nodes[n].token).collect());
            Ok(chosen.iter().map(|&n| table(nodes[n].token)).collect())
        })
        .unwrap();
        // Three depths. Paths: a .5, b .45, b-e .4275, b-e-50 .385, a-c .2, a-c-30 .18, a-d
        // .175: b's line continues, which a chain below the best token (a) would never draft.
        assert_eq!(tree.tokens, vec![1, 2, 5, 50, 3]);
        assert_eq!(tree.parents, vec![0, 0, 2, 3, 1]);
        assert_eq!(expanded[0], vec![1, 2], "both first tokens run, in one pass");
        assert_eq!(expanded[1], vec![5, 3], "the two best of depth 1");
        assert_eq!(expanded.len(), 2, "one pass per depth after the first: {expanded:?}");
        // A budget of two, filled by the first depth: only a could still have a child above b
        // (.45), so only a runs, once; none beats b.
        let mut passes = 0;
        let wide = expanding_tree(2, 3, 2, vec![(1, ln(0.5)), (2, ln(0.45))], |nodes, chosen| {
            passes += 1;
            Ok(chosen.iter().map(|&n| table(nodes[n].token)).collect())
        })
        .unwrap();
        assert_eq!((wide.tokens.clone(), passes), (vec![1, 2], 1), "{wide:?}");
        // One candidate per position and width 1: the chain.
        let chain = expanding_tree(3, 3, 1, vec![(1, ln(0.9))], |nodes, chosen| {
            Ok(chosen.iter().map(|&n| vec![(nodes[n].token + 1, ln(0.9))]).collect())
        })
        .unwrap();
        assert_eq!(chain, Draft::deterministic(vec![1, 2, 3]));
    }

    #[test]
    fn a_chain_drafter_steps_only_while_its_best_path_makes_the_tree() {
        let ln = |p: f32| p.ln();
        // The best token is right 90%, then 50%, then 10% of the time; runner-ups 5% each.
        let probs = [0.9, 0.5, 0.1, 0.1, 0.1];
        let mut steps = 0;
        let tree = chain_with_alternatives(4, 10, |_| {
            let p = probs[steps];
            steps += 1;
            Ok(vec![(steps as u32 * 10, ln(p)), (steps as u32 * 10 + 1, ln(0.05))])
        })
        .unwrap();
        // Nodes: .9, .45, then .05 (a runner-up at depth 0) beats .045 (depth 2).
        assert_eq!(tree.tokens, vec![10, 20, 11, 21]);
        assert_eq!(steps, 3, "the third position's best (.045) did not make the tree: no fourth step");
    }

    #[test]
    fn top_candidates_are_log_softmax_best_first() {
        let top = top_candidates(&[0.0, 2.0, 1.0, 2.0], 3, |i| i + 100);
        assert_eq!(top.iter().map(|c| c.0).collect::<Vec<_>>(), vec![101, 103, 102]);
        let total: f32 = [0.0f32, 2.0, 1.0, 2.0].iter().map(|l| l.exp()).sum();
        assert!((top[0].1 - (2.0f32.exp() / total).ln()).abs() < 1e-5);
        assert!(top_candidates(&[f32::NEG_INFINITY; 3], 2, |i| i).is_empty());
    }

    #[test]
    fn paths_children_and_pruning() {
        // Row 0 → nodes 0 (a), 1 (b); node 0 → node 2 (c), node 3 (d); node 2 → node 4 (e).
        let mut d = Draft::tree(vec![10, 11, 12, 13, 14], vec![0, 0, 1, 1, 3]);
        assert!(d.is_tree());
        assert_eq!(d.path(4), vec![0, 2, 4]);
        assert_eq!(d.path_tokens(3), vec![10, 13]);
        assert_eq!(d.depth(), 3);
        assert_eq!(d.children(), vec![vec![0, 1], vec![2, 3], vec![], vec![4], vec![], vec![]]);
        assert_eq!(d.forward_parents(), vec![NO_PARENT, 0, 0, 1, 1, 3]);
        // Dropping node 2 drops node 4 below it; the rest is renumbered.
        d.retain(|node, _| node != 2);
        assert_eq!(d, Draft::tree(vec![10, 11, 13], vec![0, 0, 1]));
        // A chain stays a chain.
        let mut chain = Draft::deterministic(vec![1, 2, 3, 4]);
        chain.retain(|_, path| !path.contains(&3));
        assert_eq!(chain, Draft::deterministic(vec![1, 2]));
        assert!(!Draft::tree(vec![5, 6], vec![0, 1]).is_tree(), "a chain-shaped tree is a chain");
    }
}
