//! A strict parser of the Prometheus text exposition format (0.0.4), and a
//! one-request HTTP/1.1 client to scrape it.
//!
//! Strict means: every line is a `# HELP`, a `# TYPE`, another comment, a
//! blank line or a sample; metric and label names match the format's
//! grammar; label values use only the `\\`, `\"` and `\n` escapes; a family
//! has at most one HELP and one TYPE, given before its samples, and its
//! samples are contiguous; no two samples share a name and label set;
//! counters are non-negative; a histogram has `_bucket` series with
//! increasing `le` ending in `+Inf`, non-decreasing cumulative counts, and
//! `_count` equal to the `+Inf` bucket.
//!
//! [`scrape`] also reads every exposition with the `prometheus-parse` crate
//! and checks that it finds the same samples ([`cross_check`]). That crate
//! does not replace the parser here: it is lenient by design (a line its
//! regular expressions do not match is skipped, a value that does not
//! parse is dropped, labels are split at `,` and `=` without unescaping),
//! so it cannot fail on an invalid exposition, which is what these tests
//! must detect.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// One sample: name, labels (sorted by name), value.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// A parsed exposition.
#[derive(Clone, Debug, Default)]
pub struct Exposition {
    /// Family name -> type (`counter`, `gauge`, `histogram`, `summary`, `untyped`).
    pub types: HashMap<String, String>,
    pub samples: Vec<Sample>,
}

impl Exposition {
    /// The value of the sample `name` whose labels include `labels`;
    /// panics unless exactly one matches.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let found: Vec<&Sample> = self.matching(name, labels).collect();
        assert_eq!(
            found.len(),
            1,
            "{name}{labels:?}: {} samples match",
            found.len()
        );
        found[0].value
    }

    /// Like [`Exposition::value`], 0 if no sample matches.
    pub fn value_or_zero(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let found: Vec<&Sample> = self.matching(name, labels).collect();
        assert!(
            found.len() <= 1,
            "{name}{labels:?}: {} samples match",
            found.len()
        );
        found.first().map(|s| s.value).unwrap_or(0.0)
    }

    /// The sum of every sample `name` whose labels include `labels`.
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.matching(name, labels).map(|s| s.value).sum()
    }

    pub fn matching<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [(&str, &str)],
    ) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).is_some_and(|x| x == v))
        })
    }
}

fn is_metric_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn is_label_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn parse_value(s: &str) -> Result<f64, String> {
    match s {
        "+Inf" | "Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => s.parse::<f64>().map_err(|_| format!("bad value {s:?}")),
    }
}

/// The family a sample name belongs to, given the declared types.
fn family_of<'a>(name: &'a str, types: &HashMap<String, String>) -> &'a str {
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = name.strip_suffix(suffix)
            && matches!(
                types.get(base).map(String::as_str),
                Some("histogram" | "summary")
            )
        {
            return base;
        }
    }
    name
}

/// Parses `{a="x",b="y"} rest` -> (labels, rest).
fn parse_labels(s: &str) -> Result<(BTreeMap<String, String>, &str), String> {
    let mut labels = BTreeMap::new();
    let bytes = s.as_bytes();
    let mut i = 1; // after '{'
    loop {
        if bytes.get(i) == Some(&b'}') {
            return Ok((labels, &s[i + 1..]));
        }
        let eq = s[i..].find('=').ok_or("label without '='")? + i;
        let name = &s[i..eq];
        if !is_label_name(name) {
            return Err(format!("bad label name {name:?}"));
        }
        if bytes.get(eq + 1) != Some(&b'"') {
            return Err(format!("label {name} value is not quoted"));
        }
        let mut value = String::new();
        let mut j = eq + 2;
        loop {
            match bytes.get(j) {
                None => return Err("unterminated label value".into()),
                Some(b'"') => break,
                Some(b'\\') => {
                    match bytes.get(j + 1) {
                        Some(b'\\') => value.push('\\'),
                        Some(b'"') => value.push('"'),
                        Some(b'n') => value.push('\n'),
                        other => {
                            return Err(format!("bad escape \\{:?}", other.map(|b| *b as char)));
                        }
                    }
                    j += 2;
                }
                Some(_) => {
                    let ch = s[j..].chars().next().expect("in bounds");
                    if ch == '\n' {
                        return Err("raw newline in a label value".into());
                    }
                    value.push(ch);
                    j += ch.len_utf8();
                }
            }
        }
        if labels.insert(name.to_string(), value).is_some() {
            return Err(format!("label {name} given twice"));
        }
        i = j + 1;
        match bytes.get(i) {
            Some(b',') => i += 1,
            Some(b'}') => {}
            _ => return Err("expected ',' or '}' after a label".into()),
        }
    }
}

/// Parses and checks a whole exposition.
pub fn parse(text: &str) -> Result<Exposition, String> {
    let mut out = Exposition::default();
    let mut helped: HashSet<String> = HashSet::new();
    let mut seen_families: Vec<String> = Vec::new();
    let mut closed: HashSet<String> = HashSet::new();
    let mut keys: HashSet<(String, Vec<(String, String)>)> = HashSet::new();
    if !text.is_empty() && !text.ends_with('\n') {
        return Err("the exposition does not end with a newline".into());
    }
    for (n, line) in text.lines().enumerate() {
        let at = |e: String| format!("line {}: {e}: {line:?}", n + 1);
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# ") {
            let mut parts = rest.splitn(3, ' ');
            match (parts.next(), parts.next(), parts.next()) {
                (Some("HELP"), Some(name), _) => {
                    if !is_metric_name(name) {
                        return Err(at(format!("bad metric name {name:?}")));
                    }
                    if !helped.insert(name.to_string()) {
                        return Err(at("second HELP".into()));
                    }
                }
                (Some("TYPE"), Some(name), Some(kind)) => {
                    if !is_metric_name(name) {
                        return Err(at(format!("bad metric name {name:?}")));
                    }
                    if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind) {
                        return Err(at(format!("unknown type {kind:?}")));
                    }
                    if out
                        .types
                        .insert(name.to_string(), kind.to_string())
                        .is_some()
                    {
                        return Err(at("second TYPE".into()));
                    }
                    if seen_families.contains(&name.to_string()) {
                        return Err(at("TYPE after the family's samples".into()));
                    }
                }
                _ => {} // another comment
            }
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let name_end = line.find(['{', ' ']).ok_or_else(|| at("no value".into()))?;
        let name = &line[..name_end];
        if !is_metric_name(name) {
            return Err(at(format!("bad metric name {name:?}")));
        }
        let (labels, rest) = if line[name_end..].starts_with('{') {
            parse_labels(&line[name_end..]).map_err(at)?
        } else {
            (BTreeMap::new(), &line[name_end..])
        };
        let rest = rest
            .strip_prefix(' ')
            .ok_or_else(|| at("no space before the value".into()))?;
        let mut fields = rest.split(' ');
        let value = parse_value(fields.next().unwrap_or_default()).map_err(at)?;
        if let Some(ts) = fields.next()
            && ts.parse::<i64>().is_err()
        {
            return Err(at(format!("bad timestamp {ts:?}")));
        }
        if fields.next().is_some() {
            return Err(at("trailing fields".into()));
        }
        let family = family_of(name, &out.types).to_string();
        if seen_families.last() != Some(&family) {
            if closed.contains(&family) {
                return Err(at(format!("samples of {family} are not contiguous")));
            }
            if let Some(prev) = seen_families.last() {
                closed.insert(prev.clone());
            }
            seen_families.push(family.clone());
        }
        let key = (
            name.to_string(),
            labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        );
        if !keys.insert(key) {
            return Err(at("duplicate sample".into()));
        }
        if out.types.get(&family).map(String::as_str) == Some("counter")
            && (value.is_nan() || value < 0.0)
        {
            return Err(at("negative or NaN counter".into()));
        }
        out.samples.push(Sample {
            name: name.to_string(),
            labels,
            value,
        });
    }
    check_histograms(&out)?;
    Ok(out)
}

/// A sample's labels, sorted by name.
type Labels = Vec<(String, String)>;

fn check_histograms(e: &Exposition) -> Result<(), String> {
    for (family, kind) in &e.types {
        if kind != "histogram" {
            continue;
        }
        // Group buckets by their labels without `le`.
        let mut groups: BTreeMap<Labels, Vec<(f64, f64)>> = BTreeMap::new();
        for s in e
            .samples
            .iter()
            .filter(|s| s.name == format!("{family}_bucket"))
        {
            let le = s
                .labels
                .get("le")
                .ok_or_else(|| format!("{family}_bucket without le"))?;
            let le = parse_value(le)?;
            let rest: Vec<(String, String)> = s
                .labels
                .iter()
                .filter(|(k, _)| *k != "le")
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            groups.entry(rest).or_default().push((le, s.value));
        }
        for (labels, buckets) in groups {
            let les: Vec<f64> = buckets.iter().map(|b| b.0).collect();
            if !les.windows(2).all(|w| w[0] < w[1]) || les.last() != Some(&f64::INFINITY) {
                return Err(format!(
                    "{family}{labels:?}: le not increasing to +Inf: {les:?}"
                ));
            }
            if !buckets.windows(2).all(|w| w[0].1 <= w[1].1) {
                return Err(format!("{family}{labels:?}: cumulative counts decrease"));
            }
            let want: Vec<(&str, &str)> = labels
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            let (count_name, sum_name) = (format!("{family}_count"), format!("{family}_sum"));
            let count = e
                .matching(&count_name, &want)
                .find(|s| s.labels.len() == labels.len());
            let sum = e
                .matching(&sum_name, &want)
                .find(|s| s.labels.len() == labels.len());
            match (count, sum) {
                (Some(c), Some(_)) if c.value == buckets.last().expect("non-empty").1 => {}
                (Some(c), Some(_)) => {
                    return Err(format!(
                        "{family}{labels:?}: _count {} != +Inf bucket",
                        c.value
                    ));
                }
                _ => return Err(format!("{family}{labels:?}: _count or _sum missing")),
            }
        }
    }
    Ok(())
}

/// `GET path` over HTTP/1.1 from `addr` (`host:port`): (status code,
/// content type, body).
pub fn http_get(addr: &str, path: &str) -> std::io::Result<(u16, String, String)> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: text/plain\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    let text = String::from_utf8(raw).map_err(std::io::Error::other)?;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other("no header end"))?;
    let status: u16 = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line in {head:?}")))?;
    let header = |name: &str| {
        head.lines().find_map(|l| {
            l.split_once(':')
                .filter(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.trim().to_string())
        })
    };
    let length: usize = header("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(body.len());
    if length != body.len() {
        return Err(std::io::Error::other(format!(
            "content-length {length} but {} body bytes",
            body.len()
        )));
    }
    Ok((
        status,
        header("content-type").unwrap_or_default(),
        body.to_string(),
    ))
}

/// Scrapes `url` (`http://host:port/path`) and parses it strictly; panics
/// with the text on any error.
pub fn scrape(url: &str) -> Exposition {
    let rest = url.strip_prefix("http://").expect("an http:// url");
    let (addr, path) = rest
        .split_once('/')
        .map(|(a, p)| (a, format!("/{p}")))
        .unwrap_or((rest, "/".into()));
    let (status, content_type, body) =
        http_get(addr, &path).unwrap_or_else(|e| panic!("GET {url}: {e}"));
    assert_eq!(status, 200, "GET {url}: {body}");
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "content type {content_type:?}"
    );
    let parsed =
        parse(&body).unwrap_or_else(|e| panic!("{url} is not a valid exposition: {e}\n{body}"));
    cross_check(&body, &parsed)
        .unwrap_or_else(|e| panic!("{url}: prometheus-parse disagrees: {e}\n{body}"));
    parsed
}

/// Reads `text` with the `prometheus-parse` crate and checks that it finds
/// exactly the samples of `parsed` (histogram buckets included).
pub fn cross_check(text: &str, parsed: &Exposition) -> Result<(), String> {
    use prometheus_parse::{Scrape, Value};
    let scrape =
        Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).map_err(|e| e.to_string())?;
    let mut seen = 0;
    let mut find = |name: &str,
                    labels: &std::collections::HashMap<String, String>,
                    le: Option<f64>,
                    value: f64| {
        seen += 1;
        let found = parsed.samples.iter().find(|s| {
            s.name == name
                && s.labels.len() == labels.len() + le.is_some() as usize
                && labels.iter().all(|(k, v)| s.labels.get(k) == Some(v))
                && le.is_none_or(|le| {
                    s.labels.get("le").and_then(|x| parse_value(x).ok()) == Some(le)
                })
        });
        match found {
            Some(s) if s.value == value || (s.value.is_nan() && value.is_nan()) => Ok(()),
            Some(s) => Err(format!(
                "{name}{labels:?} le={le:?}: {value} but {} here",
                s.value
            )),
            None => Err(format!(
                "{name}{labels:?} le={le:?} = {value} is not found here"
            )),
        }
    };
    for s in &scrape.samples {
        match &s.value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => {
                find(&s.metric, &s.labels, None, *v)?
            }
            Value::Histogram(buckets) => {
                for b in buckets {
                    find(
                        &format!("{}_bucket", s.metric),
                        &s.labels,
                        Some(b.less_than),
                        b.count,
                    )?;
                }
            }
            Value::Summary(_) => return Err(format!("{}: a summary", s.metric)),
        }
    }
    if seen != parsed.samples.len() {
        return Err(format!(
            "prometheus-parse read {seen} samples, {} here",
            parsed.samples.len()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_a_valid_exposition() {
        let text = "# HELP a_total A.\n# TYPE a_total counter\na_total{x=\"1\",y=\"q\\\"\\\\\\n\"} 3\na_total{x=\"2\"} 0\n\
                    # TYPE h histogram\nh_bucket{le=\"0.1\"} 1\nh_bucket{le=\"+Inf\"} 2\nh_sum 0.5\nh_count 2\ng 1.5e3\n";
        let e = parse(text).unwrap();
        assert_eq!(e.value("a_total", &[("x", "1")]), 3.0);
        assert_eq!(e.samples[0].labels["y"], "q\"\\\n");
        assert_eq!(e.value("g", &[]), 1500.0);
    }

    #[test]
    fn the_crate_reads_the_same_samples() {
        let text = "# HELP a_total A.\n# TYPE a_total counter\na_total{x=\"1\"} 3\na_total{x=\"2\"} 0\n\
                    # TYPE h histogram\nh_bucket{le=\"0.1\",p=\"q\"} 1\nh_bucket{le=\"+Inf\",p=\"q\"} 2\n\
                    h_sum{p=\"q\"} 0.5\nh_count{p=\"q\"} 2\ng 1.5e3\n";
        let e = parse(text).unwrap();
        cross_check(text, &e).unwrap();
        let mut wrong = e.clone();
        wrong.samples[1].value = 1.0;
        assert!(cross_check(text, &wrong).unwrap_err().contains("a_total"));
        wrong.samples.remove(1);
        assert!(cross_check(text, &wrong).is_err());
    }

    #[test]
    fn refuses_what_the_format_forbids() {
        for bad in [
            "a b c\n",
            "a{x=1} 2\n",
            "a{x=\"1\"} 2",
            "a{x=\"\\t\"} 2\n",
            "a 1\na 2\n",
            "# TYPE a counter\na -1\n",
            "a 1\nb 1\na{x=\"1\"} 1\n",
            "# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 1\n",
            "# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 2\nh_sum 1\nh_count 3\n",
            "# TYPE a counter\n# TYPE a gauge\n",
            "1a 2\n",
        ] {
            assert!(parse(bad).is_err(), "accepted {bad:?}");
        }
    }
}
