-- Argo CD health check for alpajob.io/AlpaJob.
--
-- An AlpaJob's status has a phase (Pending, Planning, Queued, Starting, Running,
-- Restarting, Succeeded, Failed, Suspended), kstatus's conditions and observedGeneration. This
-- maps them onto Argo CD's health:
--   Progressing  no status yet; a spec the operator has not seen (observedGeneration
--                behind metadata.generation); Pending, Planning, Queued (for Kueue's
--                quota, with Kueue's message), Starting, Restarting;
--                Running before the Ready condition is True
--   Healthy      Running and Ready; Succeeded
--   Degraded     Failed, with the failure's message
--   Suspended    Suspended
local hs = {}

local function condition(kind)
  if obj.status ~= nil and obj.status.conditions ~= nil then
    for _, c in ipairs(obj.status.conditions) do
      if c.type == kind then
        return c
      end
    end
  end
  return nil
end

local function said(c, fallback)
  if c ~= nil and c.message ~= nil and c.message ~= "" then
    return c.message
  end
  return fallback
end

if obj.status == nil or obj.status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the AlpaJob operator to pick the job up"
  return hs
end

local phase = obj.status.phase
local observed = obj.status.observedGeneration
if observed ~= nil and obj.metadata ~= nil and obj.metadata.generation ~= nil
    and observed < obj.metadata.generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to act on generation " .. obj.metadata.generation
  return hs
end

if phase == "Failed" then
  hs.status = "Degraded"
  hs.message = said(condition("Failed"), said(condition("Stalled"), "The job failed"))
elseif phase == "Suspended" then
  hs.status = "Suspended"
  hs.message = said(condition("Suspended"), "The job is suspended (spec.runPolicy.suspend)")
elseif phase == "Succeeded" then
  hs.status = "Healthy"
  hs.message = said(condition("Succeeded"), "The job finished every step")
elseif phase == "Running" then
  local ready = condition("Ready")
  if ready ~= nil and ready.status == "True" then
    hs.status = "Healthy"
    hs.message = said(ready, "Training")
  else
    hs.status = "Progressing"
    hs.message = said(ready, "Running, not yet ready")
  end
else
  hs.status = "Progressing"
  hs.message = said(condition("Reconciling"), phase)
end
return hs
