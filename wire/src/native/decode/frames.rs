//! The data frames of a message, as descriptors slice them: each range
//! checked against its frame, and every data frame used by some
//! descriptor.

use bytes::Bytes;

use crate::native::Error;

/// The data frames of a message and which of them a descriptor used.
pub(super) struct Frames<'f> {
    frames: &'f [Bytes],
    /// Inline for up to 64 frames: `vec![false; n]` was a zeroed
    /// allocation each request, which glibc serves past its per-thread
    /// cache (about 250 instructions).
    used: smallvec::SmallVec<[bool; 64]>,
}

impl<'f> Frames<'f> {
    pub(super) fn new(frames: &'f [Bytes]) -> Self {
        Frames {
            frames,
            used: smallvec::smallvec![false; frames.len()],
        }
    }

    pub(super) fn frame0(&self) -> &'f Bytes {
        &self.frames[0]
    }

    /// Bytes `offset..offset + len` of data frame `frame` (zero copy).
    pub(super) fn slice(&mut self, frame: u64, offset: u64, len: u64) -> Result<Bytes, Error> {
        let data_frames = self.frames.len() - 1;
        if frame == 0 || frame > data_frames as u64 {
            return Err(Error::FrameOutOfRange { frame, data_frames });
        }
        let f = &self.frames[frame as usize];
        match offset.checked_add(len) {
            Some(end) if end <= f.len() as u64 => {
                self.used[frame as usize] = true;
                Ok(f.slice(offset as usize..end as usize))
            }
            _ => Err(Error::RangeOutsideFrame {
                frame,
                offset,
                len,
                frame_len: f.len(),
            }),
        }
    }

    pub(super) fn all_used(&self) -> Result<(), Error> {
        match self.used.iter().skip(1).position(|u| !u) {
            Some(i) => Err(Error::UnusedFrame(i + 1)),
            None => Ok(()),
        }
    }
}
