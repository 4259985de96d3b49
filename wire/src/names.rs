//! Field names shared: a put's field names as one `Arc<str>` a name per
//! thread ([`shared_name`]), for the decoder and for `stowd`, which hands
//! each name to every unit a put reaches.

use std::cell::RefCell;
use std::collections::HashSet;
use std::sync::Arc;

/// Field names this thread has read lately: at most this many, then
/// forgotten all at once.
pub const NAMES_KEPT: usize = 4096;
/// Longer names are not kept (each is made afresh): the kept names take
/// at most `NAMES_KEPT * NAME_KEPT_BYTES` (1 MiB) a thread.
pub const NAME_KEPT_BYTES: usize = 256;

thread_local! {
    static NAMES: RefCell<HashSet<Arc<str>, foldhash::fast::RandomState>> =
        RefCell::new(HashSet::default());
}

/// `name` as an `Arc<str>`, the one this thread made for it before if
/// any.
///
/// Why: a put's fields are named again and again (the same batch keys
/// every step), and each name was a `String` in the decoded request and
/// then an `Arc<str>` for its units: two allocations and two frees a
/// field of every put, whose blocks, many of one size at once, overflow
/// glibc's per-thread cache (callgrind, a 32-field put of one row: the
/// name's allocation about 170 instructions, with its free and copy about
/// 300, twice). A name seen before is now a lookup and a reference count.
/// Bounded: past [`NAMES_KEPT`] names the thread starts over, so a client
/// that names every field afresh costs a lookup more a field, and the
/// memory of at most that many names of at most [`NAME_KEPT_BYTES`].
pub fn shared_name(name: &str) -> Arc<str> {
    if name.len() > NAME_KEPT_BYTES {
        return Arc::from(name);
    }
    NAMES.with(|names| {
        let mut names = names.borrow_mut();
        if let Some(kept) = names.get(name) {
            return kept.clone();
        }
        if names.len() >= NAMES_KEPT {
            names.clear();
        }
        let made: Arc<str> = Arc::from(name);
        names.insert(made.clone());
        made
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A name read again is the `Arc<str>` made the first time; a name
    /// over `NAME_KEPT_BYTES` is made afresh each time; past `NAMES_KEPT`
    /// names the table starts over, and names still come back equal.
    #[test]
    fn field_names_are_shared_within_bounds() {
        let a = shared_name("prompts");
        let b = shared_name("prompts");
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(&*a, "prompts");
        let long = "x".repeat(NAME_KEPT_BYTES + 1);
        let (l1, l2) = (shared_name(&long), shared_name(&long));
        assert!(!Arc::ptr_eq(&l1, &l2));
        assert_eq!(&*l1, long.as_str());
        for i in 0..NAMES_KEPT + 10 {
            assert_eq!(&*shared_name(&format!("f{i}")), format!("f{i}").as_str());
        }
        assert!(NAMES.with(|n| n.borrow().len()) <= NAMES_KEPT);
        assert_eq!(&*shared_name("prompts"), "prompts");
    }
}
