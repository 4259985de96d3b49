//! `coalesce` (packing): small pieces share copied frames, large pieces go
//! out zero-copy, and the frame budget is respected.
//!
//! With `threshold = limits.small_threshold` (64 KiB when the host sends 0)
//! and `max = limits.max_frame_bytes`:
//!
//! 1. **In order.** Pieces of `byte_len >= threshold` each go out as a
//!    `single` frame (zero copy when contiguous; a non-contiguous one is
//!    compacted by the host with one copy either way). Pieces below the
//!    threshold are coalesced, in index order, into shared copied frames of
//!    at most `max` bytes (a new frame starts when the next small piece would
//!    not fit; large pieces in between do not break a frame). A group of one
//!    small piece is sent `single` (no copy needed). Frames are listed in the
//!    order of their first piece.
//! 2. **Budget.** If that makes more than `max_frames` frames, the small
//!    pieces are packed tighter (best-fit decreasing instead of in order),
//!    then large pieces of at most `max` bytes are coalesced too, fewest
//!    first, non-contiguous before contiguous (coalescing them costs no extra
//!    copy), smallest first, until the plan fits.
//! 3. If even coalescing every piece of at most `max` bytes does not fit,
//!    the answer is `failed` (the host falls back to its built-in packer).
//!
//! No pieces give an empty plan. Cost is `O(n log² n)` for `n` pieces.

use std::collections::BTreeSet;

use stowage_guest::{
    DEFAULT_SMALL_THRESHOLD, Description, Frame, FramePlan, PackLimits, PieceInfo, Policy,
    PolicyError,
};

/// The `coalesce` packing policy.
pub struct Coalesce;

impl Policy for Coalesce {
    fn describe() -> Description {
        Description::new(
            "coalesce",
            env!("CARGO_PKG_VERSION"),
            "small pieces share copied frames, large pieces go zero-copy, within the frame budget",
        )
        .packs()
        // Its plan follows from the sizes and limits alone: the host
        // memoizes it.
        .pure()
    }

    fn pack(pieces: &[PieceInfo], limits: &PackLimits) -> Result<FramePlan, PolicyError> {
        if pieces.len() > u32::MAX as usize {
            return Err(PolicyError::InvalidInput(format!(
                "{} pieces do not fit u32 indexes",
                pieces.len()
            )));
        }
        let budget = limits.max_frames as usize;
        let threshold = limits.small_threshold_or(DEFAULT_SMALL_THRESHOLD);
        let max = limits.max_frame_bytes;

        let frames = in_order(pieces, threshold, max);
        if frames.len() <= budget {
            return Ok(FramePlan::new(frames));
        }

        // Over budget: coalesce small pieces tightly, then promote the
        // cheapest large pieces into coalesced frames.
        let small: Vec<u32> = (0..pieces.len() as u32)
            .filter(|&i| pieces[i as usize].byte_len < threshold)
            .collect();
        let mut extra: Vec<u32> = (0..pieces.len() as u32)
            .filter(|&i| {
                let p = pieces[i as usize];
                p.byte_len >= threshold && p.byte_len <= max
            })
            .collect();
        extra.sort_by_key(|&i| {
            (
                pieces[i as usize].contiguous,
                pieces[i as usize].byte_len,
                i,
            )
        });
        let plan_with = |k: usize| {
            let mut members = small.clone();
            members.extend_from_slice(&extra[..k]);
            tight(pieces, &members, max)
        };
        let all = plan_with(extra.len());
        if all.len() > budget {
            return Err(PolicyError::Failed(format!(
                "{} pieces need {} frames of at most {max} bytes, the budget is {budget}",
                pieces.len(),
                all.len()
            )));
        }
        // Fewest promoted pieces that fit (binary search; `hi` always fits).
        let (mut lo, mut hi, mut best) = (0, extra.len(), all);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let frames = plan_with(mid);
            if frames.len() <= budget {
                hi = mid;
                best = frames;
            } else {
                lo = mid + 1;
            }
        }
        Ok(FramePlan::new(best))
    }
}

stowage_guest::export_policy!(Coalesce);

/// A group of pieces as a frame: `single` when it holds one piece.
fn group_frame(ids: Vec<u32>) -> Frame {
    match ids[..] {
        [one] => Frame::Single(one),
        _ => Frame::Coalesced(ids),
    }
}

/// Frames sorted by their first piece.
fn ordered(mut frames: Vec<(u32, Frame)>) -> Vec<Frame> {
    frames.sort_by_key(|(first, _)| *first);
    frames.into_iter().map(|(_, f)| f).collect()
}

/// Step 1: large pieces single, small pieces coalesced in order.
fn in_order(pieces: &[PieceInfo], threshold: u64, max: u64) -> Vec<Frame> {
    let mut frames = Vec::new();
    let mut group: Vec<u32> = Vec::new();
    let mut bytes = 0u64;
    for (i, p) in pieces.iter().enumerate() {
        let i = i as u32;
        if p.byte_len >= threshold {
            frames.push((i, Frame::Single(i)));
            continue;
        }
        if !group.is_empty() && bytes.saturating_add(p.byte_len) > max {
            frames.push((group[0], group_frame(std::mem::take(&mut group))));
            bytes = 0;
        }
        group.push(i);
        bytes = bytes.saturating_add(p.byte_len);
    }
    if !group.is_empty() {
        frames.push((group[0], group_frame(group)));
    }
    ordered(frames)
}

/// Step 2: `members` packed best-fit decreasing into frames of at most `max`
/// bytes (a piece above `max` alone); every other piece single.
fn tight(pieces: &[PieceInfo], members: &[u32], max: u64) -> Vec<Frame> {
    let mut order = members.to_vec();
    order.sort_by(|&a, &b| {
        pieces[b as usize]
            .byte_len
            .cmp(&pieces[a as usize].byte_len)
            .then(a.cmp(&b))
    });
    let mut bins: Vec<Vec<u32>> = Vec::new();
    // (room left, bin) for bins that can take more.
    let mut room: BTreeSet<(u64, usize)> = BTreeSet::new();
    for i in order {
        let len = pieces[i as usize].byte_len;
        if let Some(&(left, b)) = room.range((len, 0)..).next() {
            room.remove(&(left, b));
            bins[b].push(i);
            room.insert((left - len, b));
        } else {
            if len <= max {
                room.insert((max - len, bins.len()));
            }
            bins.push(vec![i]);
        }
    }
    let mut is_member = vec![false; pieces.len()];
    for &i in members {
        is_member[i as usize] = true;
    }
    let mut frames: Vec<(u32, Frame)> = bins
        .into_iter()
        .map(|mut ids| {
            ids.sort_unstable();
            (ids[0], group_frame(ids))
        })
        .collect();
    frames.extend(
        (0..pieces.len() as u32)
            .filter(|&i| !is_member[i as usize])
            .map(|i| (i, Frame::Single(i))),
    );
    ordered(frames)
}

#[cfg(test)]
mod tests {
    use super::*;
    use stowage_guest::Capability;
    use stowage_guest::testing::validate_frames;

    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * KIB;

    fn limits(max_frames: u32, max_frame_bytes: u64, small_threshold: u64) -> PackLimits {
        PackLimits {
            max_frames,
            max_frame_bytes,
            small_threshold,
        }
    }

    fn pack_ok(pieces: &[PieceInfo], limits: &PackLimits) -> Vec<Frame> {
        let plan = Coalesce::pack(pieces, limits).unwrap();
        validate_frames(pieces, limits, &plan).unwrap();
        plan.frames
    }

    fn c(n: u64) -> PieceInfo {
        PieceInfo::contiguous(n)
    }

    /// Bytes copied by a plan: coalesced frames of 2+ pieces, and
    /// non-contiguous pieces anywhere.
    fn copied(pieces: &[PieceInfo], frames: &[Frame]) -> u64 {
        frames
            .iter()
            .map(|f| match f {
                Frame::Single(i) => {
                    let p = pieces[*i as usize];
                    if p.contiguous { 0 } else { p.byte_len }
                }
                Frame::Coalesced(ids) => ids.iter().map(|&i| pieces[i as usize].byte_len).sum(),
            })
            .sum()
    }

    #[test]
    fn describes_itself() {
        let d = Coalesce::describe();
        assert_eq!(d.name, "coalesce");
        assert_eq!(d.capabilities, vec![Capability::Packing]);
        let f = stowage_guest::testing::TestField::regular(stowage_guest::Dtype::Uint8, &[2, 2]);
        assert_eq!(Coalesce::select(&f, &[0]), Err(PolicyError::NotApplicable));
    }

    #[test]
    fn large_pieces_go_single_small_ones_share() {
        let pieces = [
            c(MIB),
            c(100),
            c(200),
            c(2 * MIB),
            c(300),
            PieceInfo::strided(MIB),
        ];
        let frames = pack_ok(&pieces, &limits(100, 64 * MIB, 0));
        assert_eq!(
            frames,
            vec![
                Frame::Single(0),
                Frame::Coalesced(vec![1, 2, 4]),
                Frame::Single(3),
                Frame::Single(5)
            ]
        );
        assert_eq!(copied(&pieces, &frames), 600 + MIB);
    }

    #[test]
    fn default_threshold_is_64_kib() {
        let pieces = [c(64 * KIB - 1), c(64 * KIB), c(1)];
        assert_eq!(
            pack_ok(&pieces, &limits(10, MIB, 0)),
            vec![Frame::Coalesced(vec![0, 2]), Frame::Single(1)]
        );
        // An explicit threshold wins.
        assert_eq!(
            pack_ok(&pieces, &limits(10, MIB, 10)),
            vec![Frame::Single(0), Frame::Single(1), Frame::Single(2)]
        );
    }

    #[test]
    fn coalesced_frames_respect_max_frame_bytes() {
        let pieces = vec![c(400); 10];
        let frames = pack_ok(&pieces, &limits(100, 1000, 0));
        assert_eq!(
            frames,
            vec![
                Frame::Coalesced(vec![0, 1]),
                Frame::Coalesced(vec![2, 3]),
                Frame::Coalesced(vec![4, 5]),
                Frame::Coalesced(vec![6, 7]),
                Frame::Coalesced(vec![8, 9]),
            ]
        );
    }

    #[test]
    fn a_lone_small_piece_is_single() {
        assert_eq!(
            pack_ok(&[c(10), c(MIB)], &limits(2, MIB, 0)),
            vec![Frame::Single(0), Frame::Single(1)]
        );
        // A small piece above max_frame_bytes cannot share a frame.
        let pieces = [c(50), c(500), c(50)];
        assert_eq!(
            pack_ok(&pieces, &limits(10, 100, 1000)),
            vec![Frame::Single(0), Frame::Single(1), Frame::Single(2)]
        );
    }

    #[test]
    fn empty_input() {
        assert_eq!(pack_ok(&[], &limits(0, 0, 0)), vec![]);
        assert_eq!(pack_ok(&[], &limits(5, MIB, 0)), vec![]);
    }

    #[test]
    fn zero_byte_pieces_and_zero_frame_bytes() {
        let pieces = [c(0), c(0), c(10), c(0)];
        // With max_frame_bytes 0, only zero-byte pieces can share a frame.
        let frames = pack_ok(&pieces, &limits(10, 0, 0));
        assert_eq!(
            frames,
            vec![
                Frame::Coalesced(vec![0, 1]),
                Frame::Single(2),
                Frame::Single(3)
            ]
        );
        // Over budget, the tight packing puts all zero-byte pieces together.
        let frames = pack_ok(&pieces, &limits(2, 0, 0));
        assert_eq!(
            frames,
            vec![Frame::Coalesced(vec![0, 1, 3]), Frame::Single(2)]
        );
    }

    #[test]
    fn budget_packs_small_pieces_tighter_first() {
        // In order: [600][600, 400][400] = 3 frames; tight: [600, 400] x2.
        let pieces = [c(600), c(600), c(400), c(400)];
        assert_eq!(pack_ok(&pieces, &limits(3, 1000, 0)).len(), 3);
        let frames = pack_ok(&pieces, &limits(2, 1000, 0));
        assert_eq!(
            frames,
            vec![Frame::Coalesced(vec![0, 2]), Frame::Coalesced(vec![1, 3])]
        );
    }

    #[test]
    fn budget_promotes_the_cheapest_large_pieces() {
        // 6 large contiguous pieces, budget 4: the three smallest (1, 2 and
        // 3 MiB) share one copied frame, the others stay zero-copy.
        let pieces = [
            c(5 * MIB),
            c(MIB),
            c(3 * MIB),
            c(2 * MIB),
            c(4 * MIB),
            c(6 * MIB),
        ];
        let frames = pack_ok(&pieces, &limits(4, 64 * MIB, 0));
        assert_eq!(
            frames,
            vec![
                Frame::Single(0),
                Frame::Coalesced(vec![1, 2, 3]),
                Frame::Single(4),
                Frame::Single(5)
            ]
        );
        assert_eq!(copied(&pieces, &frames), 6 * MIB);
        // Non-contiguous pieces are promoted first: they are copied anyway.
        let pieces = [
            c(MIB),
            PieceInfo::strided(8 * MIB),
            c(2 * MIB),
            PieceInfo::strided(9 * MIB),
        ];
        let frames = pack_ok(&pieces, &limits(3, 64 * MIB, 0));
        assert_eq!(
            frames,
            vec![
                Frame::Single(0),
                Frame::Coalesced(vec![1, 3]),
                Frame::Single(2)
            ]
        );
        assert_eq!(copied(&pieces, &frames), 17 * MIB);
    }

    #[test]
    fn budget_with_small_and_large_pieces() {
        // 1000 small pieces of 1 KiB and 10 large: in order fits in 11 frames.
        let mut pieces: Vec<PieceInfo> = (0..1000).map(|_| c(KIB)).collect();
        pieces.extend((0..10).map(|_| c(MIB)));
        assert_eq!(pack_ok(&pieces, &limits(11, 64 * MIB, 0)).len(), 11);
        // A budget of 5 needs large pieces coalesced too (64 MiB frames).
        let frames = pack_ok(&pieces, &limits(5, 64 * MIB, 0));
        assert!(frames.len() <= 5);
        // Frames of 4 MiB: 1000 KiB + 3 MiB, then 4 MiB + 4 MiB, ...
        let frames = pack_ok(&pieces, &limits(4, 4 * MIB, 0));
        assert_eq!(frames.len(), 4);
        assert!(matches!(
            Coalesce::pack(&pieces, &limits(2, 4 * MIB, 0)),
            Err(PolicyError::Failed(_))
        ));
    }

    #[test]
    fn impossible_budgets_fail() {
        // Three pieces above max_frame_bytes can never share a frame.
        let pieces = [c(10 * MIB); 3];
        let err = Coalesce::pack(&pieces, &limits(2, MIB, 0)).unwrap_err();
        assert!(matches!(err, PolicyError::Failed(_)), "{err:?}");
        assert!(matches!(
            Coalesce::pack(&[c(1)], &limits(0, MIB, 0)),
            Err(PolicyError::Failed(_))
        ));
        // ... but exactly enough frames is fine.
        assert_eq!(pack_ok(&pieces, &limits(3, MIB, 0)).len(), 3);
        // Budget of one frame: everything must fit in one coalesced frame.
        let pieces = [c(300), c(300), c(MIB)];
        assert!(matches!(
            Coalesce::pack(&pieces, &limits(1, MIB, 0)),
            Err(PolicyError::Failed(_))
        ));
        let frames = pack_ok(&pieces, &limits(1, MIB + 600, 0));
        assert_eq!(frames, vec![Frame::Coalesced(vec![0, 1, 2])]);
    }

    #[test]
    fn many_pieces_under_budget_or_failed() {
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..300 {
            let n = (next() % 300) as usize;
            let pieces: Vec<PieceInfo> = (0..n)
                .map(|_| {
                    let r = next();
                    let len = match r % 4 {
                        0 => r % 100,
                        1 => r % (64 * KIB),
                        2 => r % (4 * MIB),
                        _ => r % (70 * MIB),
                    };
                    PieceInfo {
                        byte_len: len,
                        contiguous: (r >> 40) % 3 != 0,
                    }
                })
                .collect();
            let lim = limits(
                (next() % 320) as u32,
                [0, 1000, MIB, 8 * MIB, 64 * MIB][(next() % 5) as usize],
                [0, 100, MIB][(next() % 3) as usize],
            );
            match Coalesce::pack(&pieces, &lim) {
                Ok(plan) => validate_frames(&pieces, &lim, &plan).unwrap(),
                Err(PolicyError::Failed(_)) => assert!(pieces.len() > lim.max_frames as usize),
                Err(e) => panic!("{e:?}"),
            }
        }
    }
}
