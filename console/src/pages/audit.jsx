// The control plane's audit log: who changed what, when, from where, how it ended. A tenant's
// key sees its own tenant's entries, an admin key everyone's. Newest pages are fetched on demand.
import { useState } from "preact/hooks";
import { get } from "../api.js";
import { Empty, ErrorBox, PageHeader, Spinner, ago, usePoll } from "../ui.jsx";

const OUTCOME = { ok: "running", refused: "paused", failed: "error" }; // badge colours

export function Audit({ me }) {
  const [subject, setSubject] = useState("");
  const [action, setAction] = useState("");
  const [pages, setPages] = useState(1);
  const query = { limit: String(50 * pages) };
  if (subject.trim()) query.subject = subject.trim();
  if (action.trim()) query.action = action.trim();
  const { data, error, loading } = usePoll(() => get("/v1/audit", { query }), 10000, [subject, action, pages]);
  const items = data?.items || [];
  return (
    <section>
      <PageHeader title="Audit log" subtitle={me.admin ? "Every tenant's calls that changed something, or tried to." : "Your tenant's calls that changed something, or tried to."} />
      <div class="toolbar">
        <input name="subject" placeholder="An id: sandbox, key, volume…" value={subject} onInput={(e) => setSubject(e.target.value)} />
        <input name="action" placeholder="Route holds: /pause, DELETE…" value={action} onInput={(e) => setAction(e.target.value)} />
      </div>
      <ErrorBox error={error} title="Audit log not loaded" />
      {loading && !data ? (
        <Spinner label="Loading the audit log" />
      ) : !items.length ? (
        <div class="card">
          <Empty title="No entries">Calls that create, change or delete something show here.</Empty>
        </div>
      ) : (
        <div class="card scroll">
          <table class="table" id="audit">
            <thead>
              <tr>
                <th>When</th>
                <th>Action</th>
                <th>Subject</th>
                <th>Key</th>
                {me.admin && <th>Tenant</th>}
                <th>Outcome</th>
              </tr>
            </thead>
            <tbody>
              {items.map((e) => (
                <tr key={e.id} data-id={e.id}>
                  <td class="muted" title={e.at}>{ago(e.at)}</td>
                  <td class="mono">{e.action}</td>
                  <td class="mono">{e.created || Object.values(e.params).pop() || "–"}</td>
                  <td class="mono muted">{e.key_id || "–"}</td>
                  {me.admin && <td class="mono muted">{e.tenant_id || "–"}</td>}
                  <td>
                    <span class={`badge badge-${OUTCOME[e.outcome]}`} title={e.request_id ? `request ${e.request_id}` : ""}>
                      <span class="dot" />
                      {e.status} {e.outcome}
                    </span>
                  </td>
                </tr>
              ))}
            </tbody>
          </table>
          {data?.next && (
            <button class="ghost" onClick={() => setPages(pages + 1)}>
              More
            </button>
          )}
        </div>
      )}
    </section>
  );
}
