// Usage: what the tenant's sandboxes and volumes were given and used over the last day, week or
// month (an admin key: every tenant's), as bars a step each, the sandboxes that used most and
// the hosts their gateways sent most to. From GET /v1/usage, measured on the hosts.
import { get } from "../api.js";
import { Empty, ErrorBox, PageHeader, Spinner, bytes, link, usePoll } from "../ui.jsx";

const HOUR = 3600;
const RANGES = {
  day: { label: "Last day", seconds: 24 * HOUR, step: HOUR },
  week: { label: "Last week", seconds: 7 * 24 * HOUR, step: 6 * HOUR },
  month: { label: "Last month", seconds: 30 * 24 * HOUR, step: 24 * HOUR },
};
// Hours of something (vCPUs, GiB): minutes while under an hour, three figures at most.
function hours(unit) {
  return (v) => (v > 0 && v < 1 ? `${(v * 60).toPrecision(3)} ${unit}·min` : `${v.toPrecision(3)} ${unit}·h`);
}

// What each chart shows: its title, how a point's figures become its bars (stacked), the unit.
const CHARTS = [
  { id: "vcpu", title: "vCPU-hours", parts: [["running", (p) => p.vcpu_seconds_running / HOUR], ["paused", (p) => p.vcpu_seconds_paused / HOUR]], unit: hours("vCPU") },
  { id: "cpu", title: "Host CPU-hours used", parts: [["used", (p) => p.cpu_seconds / HOUR]], unit: hours("CPU") },
  { id: "memory", title: "RAM GiB-hours", parts: [["running", (p) => p.memory_gib_seconds_running / HOUR], ["paused", (p) => p.memory_gib_seconds_paused / HOUR]], unit: hours("GiB") },
  { id: "egress", title: "Egress", parts: [["sent", (p) => p.egress_bytes]], unit: bytes },
  { id: "storage", title: "Storage GiB-hours", parts: [["disks", (p) => p.disk_gib_hours], ["snapshots", (p) => p.snapshot_gib_hours + p.checkpoint_gib_hours], ["volumes", (p) => p.volume_gib_hours]], unit: hours("GiB") },
];

// Every step of the range, those without usage as zero, oldest first.
function steps(answer, range) {
  const step = range.step * 1000;
  const until = Date.parse(answer.until);
  const first = Math.floor((until - range.seconds * 1000) / step) * step;
  const byAt = new Map((answer.series[0]?.points || []).map((p) => [Date.parse(p.at), p]));
  const out = [];
  for (let at = first; at <= until; at += step) out.push({ at, point: byAt.get(at) });
  return out;
}

function Bars({ chart, slots, range }) {
  const w = 600;
  const h = 120;
  const values = slots.map((s) => chart.parts.map(([, f]) => (s.point ? f(s.point) : 0)));
  const top = Math.max(...values.map((v) => v.reduce((a, b) => a + b, 0)), 1e-9);
  const total = values.reduce((a, v) => a + v.reduce((x, y) => x + y, 0), 0);
  const width = w / slots.length;
  const format = { [HOUR]: { hour: "2-digit", minute: "2-digit" }, [24 * HOUR]: { month: "short", day: "numeric" } }[range.step] || { month: "short", day: "numeric", hour: "2-digit" };
  const label = (at) => new Date(at).toLocaleString([], format);
  return (
    <div class="card chart" id={`chart-${chart.id}`}>
      <div class="chart-head">
        <span class="figure-label">{chart.title}</span>
        <span class="chart-total">{chart.unit(total)}</span>
      </div>
      <svg viewBox={`0 0 ${w} ${h}`} preserveAspectRatio="none" role="img" aria-label={`${chart.title}: ${chart.unit(total)}`}>
        {slots.map((s, i) => {
          let y = h;
          return chart.parts.map(([name], k) => {
            const bar = (values[i][k] / top) * (h - 4);
            y -= bar;
            return bar > 0 ? (
              <rect key={`${i}-${name}`} class={`bar bar-${k}`} x={i * width + 1} y={y} width={Math.max(1, width - 2)} height={bar}>
                <title>{`${label(s.at)} · ${name}: ${chart.unit(values[i][k])}`}</title>
              </rect>
            ) : null;
          });
        })}
      </svg>
      <div class="chart-axis muted">
        <span>{label(slots[0].at)}</span>
        <span class="chart-legend">
          {chart.parts.length > 1 && chart.parts.map(([name], k) => (
            <span key={name}><i class={`swatch bar-${k}`} />{name}</span>
          ))}
        </span>
        <span>{label(slots[slots.length - 1].at)}</span>
      </div>
    </div>
  );
}

export function Usage({ me, range: which }) {
  const range = RANGES[which] || RANGES.day;
  const since = () => new Date(Date.now() - range.seconds * 1000).toISOString();
  const whole = usePoll(() => get("/v1/usage", { query: { since: since(), step: `${range.step}` } }), 30000, [which]);
  const bySandbox = usePoll(() => get("/v1/usage", { query: { since: since(), step: `${range.seconds}`, by: "sandbox" } }), 30000, [which]);
  const hosts = usePoll(() => get("/v1/usage/hosts", { query: { since: since(), limit: "10" } }), 30000, [which]);
  const top = (bySandbox.data?.series || [])
    .filter((s) => s.key)
    .sort((a, b) => b.total.vcpu_seconds_running + b.total.vcpu_seconds_paused - (a.total.vcpu_seconds_running + a.total.vcpu_seconds_paused))
    .slice(0, 10);
  return (
    <section>
      <PageHeader title="Usage" subtitle={me.admin ? "Every tenant's sandboxes and volumes, measured on the hosts." : "What your sandboxes and volumes were given and used, measured on the hosts."} />
      <div class="tabs" role="tablist">
        {Object.entries(RANGES).map(([key, r]) => (
          <a key={key} role="tab" href={link(`/usage/${key}`)} class={range === r ? "active" : ""}>
            {r.label}
          </a>
        ))}
      </div>
      <ErrorBox error={whole.error} title="Usage not loaded" />
      {whole.loading && !whole.data ? (
        <Spinner label="Loading usage" />
      ) : !whole.data?.series.length ? (
        <div class="card">
          <Empty title="No usage in this range">Sandboxes are metered while they run, pause or are suspended; volumes and checkpoints while they are kept.</Empty>
        </div>
      ) : (
        <div class="charts">
          {CHARTS.map((chart) => (
            <Bars key={chart.id} chart={chart} slots={steps(whole.data, range)} range={range} />
          ))}
        </div>
      )}
      <div class="grid2 usage-tables">
        <div class="card scroll">
          <h2>Sandboxes that used most</h2>
          {top.length ? (
            <table class="table" id="usage-sandboxes">
              <thead>
                <tr><th>Sandbox</th><th>Given</th><th>Host CPU</th><th>Egress</th></tr>
              </thead>
              <tbody>
                {top.map((s) => (
                  <tr key={s.key} data-id={s.key}>
                    <td class="mono"><a href={link(`/sandboxes/${s.key}`)}>{s.key}</a></td>
                    <td>{hours("vCPU")((s.total.vcpu_seconds_running + s.total.vcpu_seconds_paused) / HOUR)}</td>
                    <td>{hours("CPU")(s.total.cpu_seconds / HOUR)}</td>
                    <td>{bytes(s.total.egress_bytes)}</td>
                  </tr>
                ))}
              </tbody>
            </table>
          ) : (
            <p class="muted">None in this range.</p>
          )}
        </div>
        <div class="card scroll">
          <h2>Hosts sent most to</h2>
          {hosts.data?.items.length ? (
            <table class="table" id="usage-hosts">
              <thead>
                <tr><th>Host</th><th>Sent</th><th>Received</th></tr>
              </thead>
              <tbody>
                {hosts.data.items.map((h) => (
                  <tr key={h.host}>
                    <td class="mono">{h.host}</td>
                    <td>{bytes(h.sent_bytes)}</td>
                    <td>{bytes(h.received_bytes)}</td>
                  </tr>
                ))}
              </tbody>
            </table>
          ) : (
            <p class="muted">No egress in this range.</p>
          )}
        </div>
      </div>
    </section>
  );
}
