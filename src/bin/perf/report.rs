//! oxccl-perf's outputs besides the table: JSON (`-J`) and an SVG plot of
//! bus bandwidth against size (`--plot`) that can overlay earlier runs.
//!
//! The JSON is flat and self-describing so that scripts (and
//! `scripts/compare-mpi.sh`) can read it without a JSON library:
//!
//! ```json
//! {"tool": "oxccl-perf", "label": "...", "collective": "all_reduce", "dtype": "float",
//!  "op": "sum", "ranks": 2, "transport": "shm", "unix_time": 1764763200,
//!  "rows": [{"bytes": 8, "count": 2, "algo": "lane",
//!            "time_us": 0.27, "algbw": 0.03, "busbw": 0.03, "wrong": 0,
//!            "time_us_ip": 0.28, "algbw_ip": 0.03, "busbw_ip": 0.03, "wrong_ip": 0}, ...]}
//! ```
//!
//! `count` is the table's count column: nccl-tests' count, per rank for
//! all_gather, reduce_scatter and all_to_all. Each row also names its
//! type, reduction and root (`"dtype"`, `"redop"`, `"root"`: the table's
//! columns), since `-d`, `-o` and `-r` may sweep several in one run; the
//! top-level `"dtype"` and `"op"` then list them (`"all"` for every one).

use super::{dtypes_text, ops_text, Args, RunResult};

/// Escapes a string for JSON.
fn quote(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A finite number for JSON (NaN and infinities become 0).
fn num(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.4}")
    } else {
        "0".into()
    }
}

pub fn to_json(label: &str, a: &Args, run: &RunResult) -> String {
    let unix_time = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut out = format!(
        "{{\"tool\": \"oxccl-perf\", \"label\": {}, \"collective\": {}, \"dtype\": {}, \
         \"op\": {}, \"ranks\": {}, \"transport\": {}, \"iters\": {}, \"samples\": {}, \
         \"unix_time\": {unix_time},\n \"rows\": [",
        quote(label),
        quote(a.coll.name()),
        quote(&dtypes_text(a)),
        quote(&ops_text(a)),
        run.ranks,
        quote(&run.transport),
        a.iters,
        a.samples,
    );
    for (i, r) in run.rows.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out += &format!(
            "\n  {{\"bytes\": {}, \"count\": {}, \"dtype\": {}, \"redop\": {}, \"root\": {}, \
             \"algo\": {}, \"time_us\": {}, \"algbw\": {}, \"busbw\": {}, \"wrong\": {}",
            r.bytes,
            a.coll.shown_count(r.count, run.ranks),
            quote(r.dtype),
            quote(r.redop),
            r.root,
            quote(&r.algo),
            num(r.time_us[0]),
            num(r.algbw[0]),
            num(r.busbw[0]),
            r.wrong[0],
        );
        // A collective without an in-place variant has no in-place fields.
        if a.coll.variants(&a.backend).len() > 1 {
            out += &format!(
                ", \"time_us_ip\": {}, \"algbw_ip\": {}, \"busbw_ip\": {}, \"wrong_ip\": {}",
                num(r.time_us[1]),
                num(r.algbw[1]),
                num(r.busbw[1]),
                r.wrong[1],
            );
        }
        out.push('}');
    }
    out.push_str("\n]}\n");
    out
}

/// What a plot needs of one run.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub label: String,
    /// `(bytes, out-of-place busbw, in-place busbw)`; a placement the run
    /// did not measure (all-to-all has no in-place form; Open MPI's
    /// broadcast and the ceiling run in place only) is `None` and is not
    /// drawn.
    pub points: Vec<(f64, Option<f64>, Option<f64>)>,
}

/// A minimal JSON reader: enough for the files [`to_json`] writes (and
/// any JSON of the same shape), with errors instead of panics.
mod json {
    #[derive(Clone, Debug, PartialEq)]
    pub enum Value {
        Null,
        Bool(bool),
        Num(f64),
        Str(String),
        Arr(Vec<Value>),
        Obj(Vec<(String, Value)>),
    }

    impl Value {
        pub fn get(&self, key: &str) -> Option<&Value> {
            match self {
                Value::Obj(fields) => fields.iter().find(|(k, _)| k == key).map(|(_, v)| v),
                _ => None,
            }
        }
        pub fn num(&self) -> Option<f64> {
            match self {
                Value::Num(x) => Some(*x),
                _ => None,
            }
        }
        pub fn str(&self) -> Option<&str> {
            match self {
                Value::Str(s) => Some(s),
                _ => None,
            }
        }
    }

    pub fn parse(text: &str) -> Result<Value, String> {
        let mut p = Parser {
            bytes: text.as_bytes(),
            at: 0,
        };
        let v = p.value(0)?;
        p.skip_ws();
        if p.at != p.bytes.len() {
            return Err(format!("trailing characters at byte {}", p.at));
        }
        Ok(v)
    }

    struct Parser<'a> {
        bytes: &'a [u8],
        at: usize,
    }

    impl Parser<'_> {
        fn skip_ws(&mut self) {
            while self
                .bytes
                .get(self.at)
                .is_some_and(|b| b.is_ascii_whitespace())
            {
                self.at += 1;
            }
        }
        fn expect(&mut self, b: u8) -> Result<(), String> {
            self.skip_ws();
            if self.bytes.get(self.at) == Some(&b) {
                self.at += 1;
                Ok(())
            } else {
                Err(format!("expected '{}' at byte {}", b as char, self.at))
            }
        }
        fn value(&mut self, depth: usize) -> Result<Value, String> {
            if depth > 64 {
                return Err("nested too deeply".into());
            }
            self.skip_ws();
            match self.bytes.get(self.at) {
                Some(b'{') => {
                    self.at += 1;
                    let mut fields = Vec::new();
                    self.skip_ws();
                    if self.bytes.get(self.at) == Some(&b'}') {
                        self.at += 1;
                        return Ok(Value::Obj(fields));
                    }
                    loop {
                        self.skip_ws();
                        let key = self.string()?;
                        self.expect(b':')?;
                        fields.push((key, self.value(depth + 1)?));
                        self.skip_ws();
                        match self.bytes.get(self.at) {
                            Some(b',') => self.at += 1,
                            Some(b'}') => {
                                self.at += 1;
                                return Ok(Value::Obj(fields));
                            }
                            _ => return Err(format!("expected ',' or '}}' at byte {}", self.at)),
                        }
                    }
                }
                Some(b'[') => {
                    self.at += 1;
                    let mut items = Vec::new();
                    self.skip_ws();
                    if self.bytes.get(self.at) == Some(&b']') {
                        self.at += 1;
                        return Ok(Value::Arr(items));
                    }
                    loop {
                        items.push(self.value(depth + 1)?);
                        self.skip_ws();
                        match self.bytes.get(self.at) {
                            Some(b',') => self.at += 1,
                            Some(b']') => {
                                self.at += 1;
                                return Ok(Value::Arr(items));
                            }
                            _ => return Err(format!("expected ',' or ']' at byte {}", self.at)),
                        }
                    }
                }
                Some(b'"') => Ok(Value::Str(self.string()?)),
                Some(b't') if self.bytes[self.at..].starts_with(b"true") => {
                    self.at += 4;
                    Ok(Value::Bool(true))
                }
                Some(b'f') if self.bytes[self.at..].starts_with(b"false") => {
                    self.at += 5;
                    Ok(Value::Bool(false))
                }
                Some(b'n') if self.bytes[self.at..].starts_with(b"null") => {
                    self.at += 4;
                    Ok(Value::Null)
                }
                Some(_) => {
                    let start = self.at;
                    while self
                        .bytes
                        .get(self.at)
                        .is_some_and(|b| b"+-.eE0123456789".contains(b))
                    {
                        self.at += 1;
                    }
                    std::str::from_utf8(&self.bytes[start..self.at])
                        .ok()
                        .and_then(|t| t.parse::<f64>().ok())
                        // `1e999` parses as infinity, which no figure is
                        // (and which the plot's axes cannot span).
                        .filter(|v| v.is_finite())
                        .map(Value::Num)
                        .ok_or_else(|| format!("bad value at byte {start}"))
                }
                None => Err("unexpected end of input".into()),
            }
        }
        fn string(&mut self) -> Result<String, String> {
            if self.bytes.get(self.at) != Some(&b'"') {
                return Err(format!("expected a string at byte {}", self.at));
            }
            self.at += 1;
            let mut out = Vec::new();
            loop {
                match self.bytes.get(self.at) {
                    None => return Err("unterminated string".into()),
                    Some(b'"') => {
                        self.at += 1;
                        return String::from_utf8(out).map_err(|_| "bad UTF-8".into());
                    }
                    Some(b'\\') => {
                        let esc = self.bytes.get(self.at + 1).copied();
                        self.at += 2;
                        match esc {
                            Some(b'n') => out.push(b'\n'),
                            Some(b't') => out.push(b'\t'),
                            Some(b'u') => {
                                let hex = self
                                    .bytes
                                    .get(self.at..self.at + 4)
                                    .and_then(|h| std::str::from_utf8(h).ok())
                                    .and_then(|h| u32::from_str_radix(h, 16).ok())
                                    .and_then(char::from_u32)
                                    .ok_or("bad \\u escape")?;
                                self.at += 4;
                                out.extend_from_slice(hex.to_string().as_bytes());
                            }
                            Some(c) => out.push(c),
                            None => return Err("unterminated escape".into()),
                        }
                    }
                    Some(&c) => {
                        out.push(c);
                        self.at += 1;
                    }
                }
            }
        }
    }
}

/// What tells one sweep's rows from another's in a run of several
/// (`-d`, `-o`, `-r`): the table's type, redop and root columns, each as
/// it would read in a label (empty where a file does not say, as files of
/// one sweep written before these fields, or other tools' files).
#[derive(Clone, Debug, PartialEq)]
struct Sweep([String; 3]);

impl Sweep {
    fn of(row: &json::Value) -> Sweep {
        let text = |k: &str| {
            row.get(k)
                .and_then(json::Value::str)
                .unwrap_or("")
                .to_string()
        };
        let root = match row.get("root").and_then(json::Value::num) {
            Some(root) if root >= 0.0 => format!("root {root}"),
            _ => String::new(),
        };
        Sweep([text("dtype"), text("redop"), root])
    }
}

/// Reads a run written by [`to_json`]: one series, or one per sweep when
/// its rows hold several, each labelled with the parts that vary between
/// them (`"… half sum"`, `"… root 1"`).
pub fn parse_json(text: &str) -> Result<Vec<Series>, String> {
    let v = json::parse(text)?;
    let label = v
        .get("label")
        .and_then(json::Value::str)
        .unwrap_or("run")
        .to_string();
    let Some(json::Value::Arr(rows)) = v.get("rows") else {
        return Err("no \"rows\" array: not an oxccl-perf JSON file".into());
    };
    let mut sweeps: Vec<(Sweep, Vec<_>)> = Vec::new();
    for row in rows {
        let field = |k: &str| row.get(k).and_then(json::Value::num);
        let (oop, ip) = (field("busbw"), field("busbw_ip"));
        let Some(bytes) = field("bytes").filter(|_| oop.is_some() || ip.is_some()) else {
            return Err("a row lacks \"bytes\", or both \"busbw\" and \"busbw_ip\"".into());
        };
        let sweep = Sweep::of(row);
        let at = match sweeps.iter().position(|(s, _)| *s == sweep) {
            Some(at) => at,
            None => {
                sweeps.push((sweep, Vec::new()));
                sweeps.len() - 1
            }
        };
        sweeps[at].1.push((bytes, oop, ip));
    }
    if sweeps.is_empty() {
        // A run of no rows is still a run (a legend entry, no line).
        return Ok(vec![Series {
            label,
            points: Vec::new(),
        }]);
    }
    let varies: Vec<bool> = (0..3)
        .map(|part| {
            sweeps
                .iter()
                .any(|(s, _)| s.0[part] != sweeps[0].0 .0[part])
        })
        .collect();
    Ok(sweeps
        .into_iter()
        .map(|(sweep, points)| {
            let mut label = label.clone();
            for (part, text) in sweep.0.iter().enumerate() {
                if varies[part] {
                    label = format!("{label} {text}");
                }
            }
            Series { label, points }
        })
        .collect())
}

fn escape_xml(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn size_label(bytes: f64) -> String {
    let b = bytes as u64;
    match b {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}G", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}K", b >> 10),
        b => format!("{b}"),
    }
}

/// Bus bandwidth against size (log scale), one solid line per run for
/// out-of-place and a dashed one for in-place.
pub fn svg(series: &[Series]) -> String {
    const W: f64 = 900.0;
    const H: f64 = 520.0;
    let (left, right, top) = (70.0, 20.0, 30.0);
    // Below the plot, one legend line per run.
    let height = H + 18.0 * series.len() as f64;
    let all = series.iter().flat_map(|s| s.points.iter());
    let (mut min_x, mut max_x, mut max_y) = (f64::MAX, 1.0f64, 0.0f64);
    for &(x, a, b) in all {
        if x > 0.0 {
            min_x = min_x.min(x);
            max_x = max_x.max(x);
        }
        max_y = max_y.max(a.unwrap_or(0.0)).max(b.unwrap_or(0.0));
    }
    if min_x == f64::MAX {
        min_x = 1.0;
    }
    let (lx0, lx1) = (
        min_x.log2().floor(),
        max_x.log2().ceil().max(min_x.log2().floor() + 1.0),
    );
    let y_step = nice_step(max_y.max(0.1) / 6.0);
    let y_top = (max_y / y_step).ceil().max(1.0) * y_step;
    let px = |x: f64| left + (x.max(1.0).log2() - lx0) / (lx1 - lx0) * (W - left - right);
    let py = |y: f64| top + (1.0 - y / y_top) * (H - top - 60.0);
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{height}\" \
         font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    out += &format!(
        "<text x=\"{}\" y=\"18\" text-anchor=\"middle\" font-size=\"14\">bus bandwidth (GB/s) against message size</text>\n",
        W / 2.0
    );
    // Grid and axes.
    let mut y = 0.0;
    while y <= y_top + 1e-9 {
        let yy = py(y);
        out += &format!(
            "<line x1=\"{left}\" y1=\"{yy:.1}\" x2=\"{}\" y2=\"{yy:.1}\" stroke=\"#ddd\"/>\
             <text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>\n",
            W - right,
            left - 6.0,
            yy + 4.0,
            trim_num(y)
        );
        y += y_step;
    }
    let every = ((lx1 - lx0) / 12.0).ceil().max(1.0) as i64;
    let mut e = lx0 as i64;
    while e as f64 <= lx1 {
        let xx = px(2f64.powi(e as i32));
        out += &format!(
            "<line x1=\"{xx:.1}\" y1=\"{top}\" x2=\"{xx:.1}\" y2=\"{:.1}\" stroke=\"#eee\"/>\
             <text x=\"{xx:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n",
            H - 60.0,
            H - 44.0,
            size_label(2f64.powi(e as i32))
        );
        e += every;
    }
    out += &format!(
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">size (bytes)</text>\n",
        (W + left) / 2.0,
        H - 24.0
    );
    const COLORS: [&str; 8] = [
        "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    ];
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let mut drawn = [false; 2];
        for (k, dash) in [(0, ""), (1, " stroke-dasharray=\"5,4\"")] {
            let pts: Vec<String> = s
                .points
                .iter()
                .filter(|p| p.0 > 0.0)
                .filter_map(|p| {
                    let y = if k == 0 { p.1 } else { p.2 }?;
                    Some(format!("{:.1},{:.1}", px(p.0), py(y)))
                })
                .collect();
            if pts.is_empty() {
                continue;
            }
            drawn[k] = true;
            out += &format!(
                "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\"{dash} points=\"{}\"/>\n",
                pts.join(" ")
            );
        }
        let legend = match drawn {
            [true, true] => "solid: out of place, dashed: in place",
            [false, true] => "dashed: in place",
            _ => "out of place",
        };
        let ly = H + 18.0 * i as f64;
        out += &format!(
            "<line x1=\"{left}\" y1=\"{ly:.1}\" x2=\"{}\" y2=\"{ly:.1}\" stroke=\"{color}\" stroke-width=\"2\"/>\
             <text x=\"{}\" y=\"{:.1}\">{} ({legend})</text>\n",
            left + 30.0,
            left + 36.0,
            ly + 4.0,
            escape_xml(&s.label)
        );
    }
    out.push_str("</svg>\n");
    out
}

/// 1, 2 or 5 times a power of ten, at least `raw`.
fn nice_step(raw: f64) -> f64 {
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * p)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * p)
}

fn trim_num(x: f64) -> String {
    let s = format!("{x:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_round_trips_through_the_reader() {
        let text = "{\"label\": \"a \\\"b\\\"\", \"rows\": [{\"bytes\": 8, \"busbw\": 1.5, \"busbw_ip\": 2}, \
                    {\"bytes\": 1e3, \"busbw\": 0.25}]}";
        let s = parse_json(text).unwrap();
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].label, "a \"b\"");
        assert_eq!(
            s[0].points,
            vec![(8.0, Some(1.5), Some(2.0)), (1000.0, Some(0.25), None)]
        );
        // In place only (Open MPI's broadcast, the ceiling).
        let ip = parse_json("{\"rows\": [{\"bytes\": 8, \"busbw_ip\": 3}]}").unwrap();
        assert_eq!(ip[0].points, vec![(8.0, None, Some(3.0))]);
        let empty = parse_json("{\"label\": \"e\", \"rows\": []}").unwrap();
        assert_eq!(
            empty,
            vec![Series {
                label: "e".into(),
                points: vec![]
            }]
        );
    }

    #[test]
    fn a_run_of_several_sweeps_reads_as_a_series_each() {
        let row = |dtype: &str, redop: &str, root: i64, bytes: u32, busbw: f64| {
            format!(
                "{{\"bytes\": {bytes}, \"dtype\": \"{dtype}\", \"redop\": \"{redop}\", \
                 \"root\": {root}, \"busbw\": {busbw}}}"
            )
        };
        let rows = [
            row("half", "sum", 0, 8, 1.0),
            row("half", "sum", 0, 64, 2.0),
            row("half", "max", 0, 8, 3.0),
            row("float", "sum", 0, 8, 4.0),
            row("float", "max", 0, 8, 5.0),
        ];
        let text = format!("{{\"label\": \"r\", \"rows\": [{}]}}", rows.join(","));
        let series = parse_json(&text).unwrap();
        let labels: Vec<_> = series.iter().map(|s| s.label.as_str()).collect();
        // The root is the same in every row: not in the labels.
        assert_eq!(
            labels,
            ["r half sum", "r half max", "r float sum", "r float max"]
        );
        assert_eq!(
            series[0].points,
            vec![(8.0, Some(1.0), None), (64.0, Some(2.0), None)]
        );
        assert_eq!(series[3].points, vec![(8.0, Some(5.0), None)]);
        // Roots alone vary (a broadcast's -r all); -1 is "no root".
        let text = format!(
            "{{\"label\": \"b\", \"rows\": [{}, {}]}}",
            row("float", "none", 0, 8, 1.0),
            row("float", "none", 1, 8, 2.0)
        );
        let labels: Vec<_> = parse_json(&text)
            .unwrap()
            .into_iter()
            .map(|s| s.label)
            .collect();
        assert_eq!(labels, ["b root 0", "b root 1"]);
        let unrooted = row("float", "sum", -1, 8, 1.0);
        let text = format!("{{\"label\": \"u\", \"rows\": [{unrooted}]}}");
        assert_eq!(parse_json(&text).unwrap()[0].label, "u");
    }

    #[test]
    fn malformed_json_is_an_error_not_a_panic() {
        for bad in [
            "",
            "{",
            "{\"rows\": [",
            "{\"rows\": 3}",
            "[1,2",
            "{\"a\" 1}",
            "\"\\u12",
            // Infinite figures (the plot's axis loop never ended on one).
            "{\"rows\": [{\"bytes\": 8, \"busbw\": 1e999}]}",
            // Neither placement.
            "{\"rows\": [{\"bytes\": 8}]}",
        ] {
            assert!(parse_json(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn svg_has_one_line_per_run_and_placement() {
        let runs = vec![
            Series {
                label: "x<y".into(),
                points: vec![
                    (8.0, Some(0.1), Some(0.2)),
                    (1048576.0, Some(5.0), Some(6.0)),
                ],
            },
            Series {
                label: "b".into(),
                points: vec![(8.0, Some(0.0), Some(0.0))],
            },
            // A placement not measured is not drawn.
            Series {
                label: "in place only".into(),
                points: vec![(8.0, None, Some(1.0)), (64.0, None, Some(2.0))],
            },
        ];
        let svg = svg(&runs);
        assert_eq!(svg.matches("<polyline").count(), 5);
        assert!(svg.contains("in place only (dashed: in place)"));
        assert!(svg.contains("x&lt;y"));
        assert!(svg.ends_with("</svg>\n"));
    }
}
