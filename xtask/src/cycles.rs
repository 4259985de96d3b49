//! `cargo xtask cycles`, and the first step of `cargo xtask test`: no
//! import cycle between the top-level modules of any crate of the
//! workspace, so that a reader can follow each crate one way down (as the
//! crates themselves depend on each other one way).
//!
//! A crate's top-level modules are the files and directories right under
//! its `src/` (`cache.rs`, `policy/`, ...; `bin/` is not one). Module `a`
//! uses module `b` when code of `a` names `crate::b` (or `super::b` from
//! where `super` is the crate root), in a path or a `use` group. Test code
//! is left out: files named `tests.rs` or under a `tests/` folder, and the
//! `#[cfg(test)] mod ... { }` blocks, which may reach anywhere. Line
//! comments (doc links among them) do not count.
//!
//! A cycle is a set of modules each reachable from the others
//! (strongly connected, Tarjan). [`KNOWN`] lists the cycles left to take
//! apart, each as its sorted module names: the check fails on any other
//! cycle, and on a known one that is gone (so the list only shrinks).
//!
//! It also checks that a crate root with a module table (a `//! | module |`
//! table in `lib.rs`) names every module it declares there, as
//! ``[`name`]``: the table is where a reader starts.
//!
//! It reads the source as text, with these rules, rather than with a Rust
//! parser: the rules above are all it needs, and it runs in milliseconds
//! (`syn` would add a dependency and seconds of build to every xtask).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use super::{Result, workspace_root};

/// The crates checked: their `src` folders, from the workspace root.
const CRATES: &[&str] = &[
    "plan/src",
    "index/src",
    "wire/src",
    "transport/src",
    "host/src",
    "guest-sdk/src",
    "clients/python/core/src",
    "xtask/src",
    "tests/src",
];

/// Cycles not yet taken apart: (crate, its modules, sorted). None now; a
/// change that must land in steps may list one here for a while.
const KNOWN: &[(&str, &[&str])] = &[];

pub fn cycles(args: &[String]) -> Result<()> {
    if let Some(a) = args.first() {
        return Err(format!("unknown argument `{a}`").into());
    }
    check(&workspace_root(), CRATES, KNOWN)
}

/// Checks every crate of `crates` under `root` (module docs).
pub fn check(root: &Path, crates: &[&str], known: &[(&str, &[&str])]) -> Result<()> {
    let mut problems = Vec::new();
    let mut seen_known = BTreeSet::new();
    for krate in crates {
        let src = root.join(krate);
        if !src.is_dir() {
            return Err(format!("cycles: no folder {}", src.display()).into());
        }
        problems.extend(module_table(krate, &src)?);
        let graph = Graph::read(root, &src)?;
        for cycle in graph.cycles() {
            let names: Vec<&str> = cycle.iter().map(String::as_str).collect();
            if known
                .iter()
                .any(|(k, m)| k == krate && *m == names.as_slice())
            {
                seen_known.insert((krate.to_string(), cycle.clone()));
                continue;
            }
            let mut text = format!(
                "{krate}: modules {} use each other:",
                cycle.iter().cloned().collect::<Vec<_>>().join(", ")
            );
            for ((from, to), at) in &graph.uses {
                if cycle.contains(from) && cycle.contains(to) {
                    text.push_str(&format!("\n  {from} -> {to}: {at}"));
                }
            }
            problems.push(text);
        }
    }
    for (krate, modules) in known {
        let cycle: BTreeSet<String> = modules.iter().map(|m| m.to_string()).collect();
        if crates.contains(krate) && !seen_known.contains(&(krate.to_string(), cycle)) {
            problems.push(format!(
                "{krate}: the known cycle {modules:?} is gone: take it out of KNOWN in xtask/src/cycles.rs"
            ));
        }
    }
    if problems.is_empty() {
        eprintln!(
            "xtask: no module cycles in {} crates, and their module tables are whole",
            crates.len()
        );
        return Ok(());
    }
    Err(format!(
        "module cycles (see xtask/src/cycles.rs):\n{}",
        problems.join("\n")
    )
    .into())
}

/// The modules `lib.rs` declares that its module table does not name
/// (nothing if it has no table).
fn module_table(krate: &str, src: &Path) -> Result<Vec<String>> {
    let Ok(lib) = std::fs::read_to_string(src.join("lib.rs")) else {
        return Ok(Vec::new());
    };
    let table: Vec<&str> = lib.lines().filter(|l| l.starts_with("//! |")).collect();
    if !table.iter().any(|l| l.starts_with("//! | module |")) {
        return Ok(Vec::new());
    }
    let mut missing = Vec::new();
    for line in lib.lines() {
        let t = line.trim();
        let decl = t
            .strip_prefix("pub mod ")
            .or_else(|| t.strip_prefix("pub(crate) mod "))
            .or_else(|| t.strip_prefix("mod "));
        let Some(name) = decl.and_then(|d| d.strip_suffix(';')) else {
            continue;
        };
        if !table.iter().any(|l| l.contains(&format!("[`{name}`]"))) {
            missing.push(format!(
                "{krate}/lib.rs: module `{name}` is not in the crate's module table"
            ));
        }
    }
    Ok(missing)
}

/// The top-level modules of one crate and which use which.
struct Graph {
    modules: BTreeSet<String>,
    /// (user, used) -> the first place it happens (`file:line: text`).
    uses: BTreeMap<(String, String), String>,
}

impl Graph {
    fn read(root: &Path, src: &Path) -> Result<Graph> {
        let mut files = Vec::new();
        rust_files(src, &mut files)?;
        files.sort();
        let mut modules = BTreeSet::new();
        for f in &files {
            if let Some(top) = module_path(src, f).first() {
                modules.insert(top.clone());
            }
        }
        let mut uses = BTreeMap::new();
        for f in &files {
            let path = module_path(src, f);
            let Some(top) = path.first().cloned() else {
                continue; // lib.rs, main.rs: the crate root uses everything
            };
            let rel = f.strip_prefix(src).unwrap_or(f);
            if top == "bin"
                || rel.file_name().is_some_and(|n| n == "tests.rs")
                || rel.components().any(|c| c.as_os_str() == "tests")
            {
                continue;
            }
            let text = std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
            for (line_no, line) in code_lines(&text) {
                for used in named_modules(&line, &path) {
                    if used != top && modules.contains(&used) {
                        uses.entry((top.clone(), used)).or_insert_with(|| {
                            let shown = f.strip_prefix(root).unwrap_or(f);
                            format!("{}:{line_no}: {}", shown.display(), line.trim())
                        });
                    }
                }
            }
        }
        Ok(Graph { modules, uses })
    }

    /// Every set of two or more modules that reach each other, sorted.
    fn cycles(&self) -> Vec<BTreeSet<String>> {
        let names: Vec<&String> = self.modules.iter().collect();
        let at = |m: &String| names.iter().position(|n| *n == m);
        let mut next: Vec<Vec<usize>> = vec![Vec::new(); names.len()];
        for (from, to) in self.uses.keys() {
            if let (Some(a), Some(b)) = (at(from), at(to)) {
                next[a].push(b);
            }
        }
        let mut out: Vec<BTreeSet<String>> = tarjan(&next)
            .into_iter()
            .filter(|c| c.len() > 1)
            .map(|c| c.into_iter().map(|i| names[i].clone()).collect())
            .collect();
        out.sort();
        out
    }
}

/// Strongly connected components (Tarjan's algorithm, iterative).
fn tarjan(next: &[Vec<usize>]) -> Vec<Vec<usize>> {
    let n = next.len();
    let (mut index, mut low) = (vec![usize::MAX; n], vec![0; n]);
    let (mut on_stack, mut stack, mut out) = (vec![false; n], Vec::new(), Vec::new());
    let mut counter = 0;
    for root in 0..n {
        if index[root] != usize::MAX {
            continue;
        }
        // (node, next edge to look at)
        let mut work = vec![(root, 0usize)];
        while let Some(top) = work.last_mut() {
            let v = top.0;
            if top.1 == 0 && index[v] == usize::MAX {
                index[v] = counter;
                low[v] = counter;
                counter += 1;
                stack.push(v);
                on_stack[v] = true;
            }
            if let Some(&w) = next[v].get(top.1) {
                top.1 += 1;
                if index[w] == usize::MAX {
                    work.push((w, 0));
                } else if on_stack[w] {
                    low[v] = low[v].min(index[w]);
                }
                continue;
            }
            work.pop();
            if let Some(&(parent, _)) = work.last() {
                low[parent] = low[parent].min(low[v]);
            }
            if low[v] == index[v] {
                let mut comp = Vec::new();
                while let Some(w) = stack.pop() {
                    on_stack[w] = false;
                    comp.push(w);
                    if w == v {
                        break;
                    }
                }
                out.push(comp);
            }
        }
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            rust_files(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// The module a file is (`a/b.rs` and `a/b/mod.rs`: `[a, b]`; `lib.rs`,
/// `main.rs`: the root, `[]`).
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap_or(file).with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    if parts.len() == 1 && (parts[0] == "lib" || parts[0] == "main") {
        parts.clear();
    }
    parts
}

/// The lines of `text` that are code: line comments cut off, and the
/// `#[cfg(test)] mod name { ... }` blocks left out (by counting braces).
fn code_lines(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut lines = text.lines().enumerate().peekable();
    let mut test_attr = false;
    while let Some((i, raw)) = lines.next() {
        let line = strip_comment(raw);
        let t = line.trim();
        if t == "#[cfg(test)]" {
            test_attr = true;
            continue;
        }
        if test_attr && t.starts_with("mod ") && t.ends_with('{') {
            // Skip to the brace that closes this one.
            let mut depth = brace_balance(&line);
            while depth > 0 {
                let Some((_, raw)) = lines.next() else { break };
                depth += brace_balance(&strip_comment(raw));
            }
            test_attr = false;
            continue;
        }
        if !t.is_empty() && !t.starts_with("#[") {
            test_attr = false;
        }
        out.push((i + 1, line));
    }
    out
}

fn brace_balance(line: &str) -> i64 {
    line.chars().fold(0, |d, c| match c {
        '{' => d + 1,
        '}' => d - 1,
        _ => d,
    })
}

/// `line` without its line comment: from a `//` at the start or after
/// whitespace (so `"tcp://..."` in a string stays).
fn strip_comment(line: &str) -> String {
    let b = line.as_bytes();
    for i in 0..b.len().saturating_sub(1) {
        if b[i] == b'/' && b[i + 1] == b'/' && (i == 0 || b[i - 1].is_ascii_whitespace()) {
            return line[..i].to_string();
        }
    }
    line.to_string()
}

/// The crate's top-level modules `line` names from module `path`:
/// `crate::x`, `super::...::x` that reaches the root, and the names of a
/// `crate::{..}` or root `super::{..}` group.
fn named_modules(line: &str, path: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(pos) = find_path_start(rest) {
        let (depth, after) = prefix_depth(&rest[pos..]);
        // `crate::` is depth usize::MAX (the root from anywhere); `super::`
        // repeated n times goes n modules up from `path`.
        let at_root = depth == usize::MAX || depth == path.len();
        if at_root {
            if let Some(group) = after.strip_prefix('{') {
                let end = group.find('}').unwrap_or(group.len());
                for item in group[..end].split(',') {
                    let name: String = ident(item.trim());
                    if !name.is_empty() && name != "self" {
                        out.push(name);
                    }
                }
            } else {
                let name = ident(after);
                if !name.is_empty() {
                    out.push(name);
                }
            }
        }
        let consumed = rest.len() - after.len();
        rest = &rest[consumed.max(pos + 1)..];
    }
    out
}

/// Where the next `crate::` or `super::` path starts in `s` (at a word
/// boundary).
fn find_path_start(s: &str) -> Option<usize> {
    let mut from = 0;
    loop {
        let c = s[from..].find("crate::").map(|i| i + from);
        let p = s[from..].find("super::").map(|i| i + from);
        let i = match (c, p) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b)?,
        };
        let boundary = i == 0 || {
            let prev = s.as_bytes()[i - 1];
            !(prev.is_ascii_alphanumeric() || prev == b'_')
        };
        if boundary {
            return Some(i);
        }
        from = i + 1;
    }
}

/// How far up a path's prefix goes: usize::MAX for `crate::`, n for n
/// `super::`; and the rest of the path after it.
fn prefix_depth(s: &str) -> (usize, &str) {
    if let Some(rest) = s.strip_prefix("crate::") {
        return (usize::MAX, rest);
    }
    let mut depth = 0;
    let mut rest = s;
    while let Some(r) = rest.strip_prefix("super::") {
        depth += 1;
        rest = r;
    }
    (depth, rest)
}

fn ident(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str, files: &[(&str, &str)]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("xtask-cycles-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for (name, text) in files {
            let p = dir.join("src").join(name);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        dir
    }

    #[test]
    fn a_cycle_is_found_and_named_with_where_each_use_is() {
        let root = scratch(
            "found",
            &[
                ("lib.rs", "pub mod a;\npub mod b;\npub mod c;\n"),
                ("a.rs", "use crate::b::Thing;\n"),
                ("b/mod.rs", "mod inner;\n"),
                // b's submodule reaches a through super::super
                ("b/inner.rs", "fn f() { super::super::a::g(); }\n"),
                (
                    "c.rs",
                    "use crate::{a, b::X}; // c uses both, nobody uses c\n",
                ),
            ],
        );
        let err = check(&root, &["src"], &[]).unwrap_err().to_string();
        assert!(err.contains("src: modules a, b use each other"), "{err}");
        assert!(
            err.contains("a -> b: ") && err.contains("a.rs:1: use crate::b::Thing;"),
            "{err}"
        );
        assert!(
            err.contains("b -> a: ") && err.contains("super::super::a::g()"),
            "{err}"
        );
        assert!(!err.contains("c,") && !err.contains(", c"), "{err}");
        // Known: passes; and a known cycle that is gone fails.
        check(&root, &["src"], &[("src", &["a", "b"])]).unwrap();
        let gone = check(
            &root,
            &["src"],
            &[("src", &["a", "b"]), ("src", &["a", "c"])],
        )
        .unwrap_err()
        .to_string();
        assert!(
            gone.contains("the known cycle [\"a\", \"c\"] is gone"),
            "{gone}"
        );
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn a_module_missing_from_the_table_is_named() {
        let root = scratch(
            "table",
            &[
                (
                    "lib.rs",
                    "//! | module | what |\n//! |---|---|\n//! | [`a`] | A |\npub mod a;\nmod b;\n",
                ),
                ("a.rs", ""),
                ("b.rs", ""),
            ],
        );
        let err = check(&root, &["src"], &[]).unwrap_err().to_string();
        assert!(
            err.contains("src/lib.rs: module `b` is not in the crate's module table"),
            "{err}"
        );
        assert!(!err.contains("module `a`"), "{err}");
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn test_code_comments_and_strings_do_not_count() {
        let root = scratch(
            "ignored",
            &[
                ("lib.rs", "pub mod a;\npub mod b;\n"),
                ("a.rs", "use crate::b::Thing;\n"),
                (
                    "b.rs",
                    "/// See [`crate::a`].\nconst E: &str = \"tcp://x\"; // crate::a\n\
                 #[cfg(test)]\nmod tests {\n    use crate::a::*;\n    fn f() { if true { } }\n}\n",
                ),
                ("b/tests.rs", "use crate::a::Y;\n"),
                ("tests/helpers.rs", "use crate::a::Z;\n"),
            ],
        );
        check(&root, &["src"], &[]).unwrap();
        let _ = std::fs::remove_dir_all(&root);
    }
}
