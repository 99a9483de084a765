// Every sandbox of the tenant, live, with filters; and a new one.
import { useState } from "preact/hooks";
import { get, json } from "../api.js";
import { Dialog, Empty, ErrorBox, Field, PageHeader, Spinner, StateBadge, ago, link, mib, pairs, usePoll } from "../ui.jsx";

const STATES = ["running", "paused", "suspended", "pending", "starting", "error", "deleted"];
const REFRESH_MS = 3000;

function Usage() {
  const { data } = usePoll(() => get("/v1/quotas"), 10000);
  if (!data) return null;
  const { used, quotas } = data;
  const meter = (label, u, q, fmt = String) => (
    <div class="meter" key={label}>
      <div class="meter-label">
        <span>{label}</span>
        <span class="muted">
          {fmt(u)} / {fmt(q)}
        </span>
      </div>
      <div class="meter-bar">
        {/* Set through the CSSOM, which the page's CSP allows (a style attribute it would not). */}
        <div class={`meter-fill ${u >= q ? "full" : ""}`} style={{ width: `${Math.min(100, (100 * u) / Math.max(q, 1))}%` }} />
      </div>
    </div>
  );
  return (
    <div class="meters">
      {meter("Sandboxes", used.sandboxes, quotas.sandboxes)}
      {meter("vCPUs", used.vcpus, quotas.vcpus)}
      {meter("Memory", used.memory_mib, quotas.memory_mib, mib)}
      {meter("Volumes", used.volumes, quotas.volumes)}
    </div>
  );
}

function CreateDialog({ onClose, onCreated }) {
  const templates = usePoll(() => get("/v1/templates"), 0);
  const [form, setForm] = useState({ template: "base", vcpus: 1, memory_mib: 256, disk_mib: 1024, timeout_s: 300, timeout_action: "pause", metadata: "", hosts: "" });
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState(null);
  const set = (k) => (e) => setForm({ ...form, [k]: e.target.value });
  const submit = async (e) => {
    e.preventDefault();
    setBusy(true);
    setError(null);
    try {
      const body = {
        template: form.template,
        vcpus: Number(form.vcpus),
        memory_mib: Number(form.memory_mib),
        disk_mib: Number(form.disk_mib),
        timeout_s: Number(form.timeout_s),
        timeout_action: form.timeout_action,
        metadata: pairs(form.metadata),
      };
      const hosts = form.hosts.split(/[\s,]+/).filter(Boolean);
      if (hosts.length) body.network = { hosts: hosts.map((pattern) => ({ pattern })) };
      const sb = await json("POST", "/v1/sandboxes", { body });
      onCreated(sb);
    } catch (err) {
      setError(err);
      setBusy(false);
    }
  };
  const usable = (templates.data?.items || []).filter((t) => t.state === "ready");
  return (
    <Dialog
      title="New sandbox"
      onClose={onClose}
      footer={
        <>
          <button class="ghost" onClick={onClose}>
            Cancel
          </button>
          <button class="primary" type="submit" form="create-sandbox" disabled={busy}>
            {busy ? <Spinner label="Starting" /> : "Create sandbox"}
          </button>
        </>
      }
    >
      <form id="create-sandbox" class="grid2" onSubmit={submit}>
        <Field label="Template">
          <select name="template" value={form.template} onChange={set("template")}>
            {(usable.length ? usable : [{ id: "base" }]).map((t) => (
              <option key={t.id} value={t.id}>
                {t.id}
              </option>
            ))}
          </select>
        </Field>
        <Field label="vCPUs">
          <input name="vcpus" type="number" min="1" max="64" value={form.vcpus} onInput={set("vcpus")} />
        </Field>
        <Field label="Memory (MiB)">
          <input name="memory_mib" type="number" min="128" step="64" value={form.memory_mib} onInput={set("memory_mib")} />
        </Field>
        <Field label="Disk (MiB)">
          <input name="disk_mib" type="number" min="256" step="256" value={form.disk_mib} onInput={set("disk_mib")} />
        </Field>
        <Field label="Timeout (s)">
          <input name="timeout_s" type="number" min="1" value={form.timeout_s} onInput={set("timeout_s")} />
        </Field>
        <Field label="When it times out">
          <select name="timeout_action" value={form.timeout_action} onChange={set("timeout_action")}>
            <option value="pause">pause</option>
            <option value="suspend">suspend</option>
            <option value="delete">delete</option>
          </select>
        </Field>
        <Field label="Metadata" hint="key=value, one per line or comma-separated">
          <textarea name="metadata" rows="2" value={form.metadata} onInput={set("metadata")} placeholder="team=search" />
        </Field>
        <Field label="Allowed hosts" hint="egress is denied unless a host is named here">
          <textarea name="hosts" rows="2" value={form.hosts} onInput={set("hosts")} placeholder="pypi.org *.pythonhosted.org" />
        </Field>
      </form>
      <ErrorBox error={error} title="Not created" />
    </Dialog>
  );
}

export function Sandboxes() {
  const [state, setState] = useState("");
  const [template, setTemplate] = useState("");
  const [metadata, setMetadata] = useState("");
  const [id, setId] = useState("");
  const [showDeleted, setShowDeleted] = useState(false);
  const [creating, setCreating] = useState(false);
  const [pages, setPages] = useState(1);
  let filterError = null;
  // Deleted sandboxes are history: left out unless asked for.
  const query = { state, template, limit: 50 * pages, deleted: String(showDeleted || state === "deleted") };
  if (id.trim()) query.id = id.trim();
  try {
    for (const [k, v] of Object.entries(pairs(metadata))) query[`metadata.${k}`] = v;
  } catch (e) {
    filterError = e;
  }
  const list = usePoll(() => get("/v1/sandboxes", { query }), REFRESH_MS, [state, template, metadata, pages, id, showDeleted]);
  const templates = usePoll(() => get("/v1/templates"), 0);
  const items = list.data?.items || [];
  const filtered = state || template || metadata || id;
  return (
    <section>
      <PageHeader title="Sandboxes" subtitle="MicroVMs of your tenant. The list refreshes by itself.">
        <span class={`live ${list.error ? "live-off" : ""}`}>{list.error ? "offline" : "live"}</span>
        <button class="primary" onClick={() => setCreating(true)}>
          New sandbox
        </button>
      </PageHeader>
      <Usage />
      <div class="toolbar">
        <select aria-label="State" name="state" value={state} onChange={(e) => setState(e.target.value)}>
          <option value="">Every state</option>
          {STATES.map((s) => (
            <option key={s} value={s}>
              {s}
            </option>
          ))}
        </select>
        <select aria-label="Template" name="template-filter" value={template} onChange={(e) => setTemplate(e.target.value)}>
          <option value="">Every template</option>
          {(templates.data?.items || []).map((t) => (
            <option key={t.id} value={t.id}>
              {t.id}
            </option>
          ))}
        </select>
        <input class="grow" name="metadata-filter" aria-label="Metadata filter" placeholder="Filter by metadata: key=value, …" value={metadata} onInput={(e) => setMetadata(e.target.value)} />
        <input name="id-filter" aria-label="Sandbox id" placeholder="Id starts with…" value={id} onInput={(e) => setId(e.target.value)} />
        <label class="check">
          <input type="checkbox" name="show-deleted" checked={showDeleted} onChange={(e) => setShowDeleted(e.target.checked)} /> deleted
        </label>
      </div>
      {filterError && <ErrorBox error={filterError} title="Filter not understood" />}
      <ErrorBox error={list.error} title="Sandboxes not loaded" />
      {list.loading && !list.data ? (
        <div class="card pad">
          <Spinner label="Loading sandboxes" />
        </div>
      ) : items.length === 0 ? (
        <div class="card">
          <Empty
            title={filtered ? "No sandbox matches" : "No sandboxes yet"}
            action={
              !filtered && (
                <button class="primary" onClick={() => setCreating(true)}>
                  Create your first sandbox
                </button>
              )
            }
          >
            {filtered ? "Change the filters to see more." : "A sandbox is a microVM of its own, started from a template in well under a second."}
          </Empty>
        </div>
      ) : (
        <div class="card scroll">
          <table class="table" id="sandbox-table">
            <thead>
              <tr>
                <th>Sandbox</th>
                <th>State</th>
                <th>Template</th>
                <th>Boot</th>
                <th>Size</th>
                <th>Age</th>
                <th>Metadata</th>
              </tr>
            </thead>
            <tbody>
              {items.map((sb) => (
                <tr key={sb.id} class={sb.state === "deleted" ? "dim" : ""} data-id={sb.id}>
                  <td>
                    <a class="mono" href={link(`/sandboxes/${sb.id}`)}>
                      {sb.id}
                    </a>
                  </td>
                  <td>
                    <StateBadge state={sb.state} />
                  </td>
                  <td>{sb.template}</td>
                  <td>{sb.boot ? <span class={`boot boot-${sb.boot}`}>{sb.boot}</span> : <span class="muted">—</span>}</td>
                  <td class="muted">
                    {sb.vcpus} vCPU · {mib(sb.memory_mib)}
                  </td>
                  <td class="muted" title={sb.created_at}>
                    {ago(sb.created_at)}
                  </td>
                  <td>
                    {Object.entries(sb.metadata).map(([k, v]) => (
                      <button key={k} class="chip" title="Filter by this" onClick={() => setMetadata(`${k}=${v}`)}>
                        {k}={v}
                      </button>
                    ))}
                  </td>
                </tr>
              ))}
            </tbody>
          </table>
          {list.data?.next_cursor && (
            <div class="pad center">
              <button class="ghost" onClick={() => setPages(pages + 1)}>
                Show more
              </button>
            </div>
          )}
        </div>
      )}
      {creating && (
        <CreateDialog
          onClose={() => setCreating(false)}
          onCreated={(sb) => {
            setCreating(false);
            location.hash = `#/sandboxes/${sb.id}`;
          }}
        />
      )}
    </section>
  );
}
